"""One module per CLI subcommand (see ``elesium.cli``)."""
