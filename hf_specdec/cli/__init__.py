"""The `hf-specdec` command line."""
