"""Training data: datasets and the deterministic batches each step draws from them."""
