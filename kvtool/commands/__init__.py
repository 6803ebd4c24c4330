"""One module per subcommand; each has ``register(app)`` and ``ORDER`` (see :mod:`kvtool.cli`)."""
