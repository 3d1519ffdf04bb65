"""The command line: the Typer app and exit codes, the shared options, one module per command group, the live line."""
