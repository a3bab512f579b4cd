"""The `zerojax` command: plan, config explain, export, launch."""
