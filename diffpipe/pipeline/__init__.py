"""Stages from the unit dataflow, and the runtime that trains them on torch.distributed.pipelining."""
