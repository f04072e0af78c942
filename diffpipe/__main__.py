"""`python -m diffpipe ...` (as torchrun needs): the same as the `diffpipe` command."""
import sys

from .cli import main

sys.exit(main())
