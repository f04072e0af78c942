"""Model adapters: backbones described as ordered units and the named tensors they read and write."""
