"""What each `diffpipe` command does, one module per command; cli.py parses the arguments and hands off."""
