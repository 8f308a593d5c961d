"""The subcommands of ``webhook-gateway``: one module each (``gateway.cli`` dispatches)."""
