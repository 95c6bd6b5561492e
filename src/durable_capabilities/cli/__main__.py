"""`python -m durable_capabilities.cli`: the `durcap` command."""

from durable_capabilities.cli import main

main()
