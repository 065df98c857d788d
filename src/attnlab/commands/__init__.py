"""Command families of the `attnlab` CLI, one module each; cli.build_parser registers them."""
