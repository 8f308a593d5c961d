"""The subcommands' logic, one module each; ``gateway.cli`` parses, ``gateway.__main__`` dispatches."""
