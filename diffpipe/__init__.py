"""diffpipe: pipeline-parallel training of diffusion models on torch.distributed.pipelining."""

__version__ = "0.1.0"
