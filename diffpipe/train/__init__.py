"""The training loop, optimizer utilities and run records."""
