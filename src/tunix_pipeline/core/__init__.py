"""What every layer uses, importing nothing of ours above it: user errors, paths and gs:// URIs, processes, the
runtime and its mesh, progress lines, quieting, the full-disk message.

Start-up: Kedro imports `settings.py` for every command (`kedro --help`, a mistyped `--env`), and with it the hooks,
the config and the parts of this package they use; those import JAX, Tunix, MLflow and transformers inside the
functions that need them (marked `start-up`), so that such a command answers in about a second, not ten.
`tests/test_layout.py` holds it."""
