"""CLI subcommands; each module exposes ``register(subparsers)`` (see ``multiguess.cli``)."""
