"""Tunix's jitted steps take no compiler options (`docs/upstream_tunix.md`, under that heading)."""

from __future__ import annotations

import jax


class jit_with_options:
    """Within this block, `jax.jit` (which `nnx.jit` calls) compiles with `options`.

    Tunix builds its train and eval steps with `nnx.jit` and its sampler's decode loop with `jax.jit`, neither taking
    compiler options; this passes ours to the `jax.jit` underneath, only while they are built (a moment, on the
    thread that builds the trainer's steps or the sampler).
    """

    def __init__(self, options: dict):
        self.options, self.original = options, None

    def __enter__(self):
        if self.options:
            self.original = original = jax.jit
            options = self.options

            def jit(*args, **kwargs):
                kwargs.setdefault("compiler_options", options)
                return original(*args, **kwargs)

            jax.jit = jit
        return self

    def __exit__(self, *exc):
        if self.original is not None:
            jax.jit = self.original
