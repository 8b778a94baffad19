"""The figures XLA:TPU gave the programs the suite's tests compile for TPU topologies on this CPU (libtpu's
compile-only devices), kept as the shipped recipes' figures are (`planning/compiled_figures.py`): under the
lowered program's text, the compiler options, the devices and the JAX, jaxlib and libtpu versions.

The test set-up writes them into the run's figures folder before any test starts, so a test compiles a program
only where it is not the one kept: a changed program, shape or compiler version misses its key and compiles as
before (a minute or more each: Gemma-2B's step at one layer for the estimate's grid, GRPO's Gemma-2-2B and
Gemma 3 programs), and a figure read back is the one XLA:TPU would give again. After changing what those tests
compile, run them with an empty cache and keep what they compiled:

    JAX_COMPILATION_CACHE_DIR=$(mktemp -d) .venv/bin/python -m pytest tests/test_tpu_compile.py tests/test_planning_grpo.py
    .venv/bin/python -m tests.xla_tpu_figures <that folder>/xla-figures
"""

import json
import os
import sys
from pathlib import Path

KEPT = Path(__file__).with_name("xla_tpu_figures.json")


def seed(folder: Path) -> None:
    """Each kept program's figures in `folder` (the figures folder beside JAX's cache), where it has none; a folder
    that cannot be written leaves the tests to compile them."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
        for key, figures in json.loads(KEPT.read_text())["figures"].items():
            path = folder / f"{key}.json"
            if not path.exists():
                tmp = path.with_name(f"{key}.{os.getpid()}.tmp")
                tmp.write_text(json.dumps(figures))
                os.replace(tmp, path)  # whole or absent: a worker may read it now
    except OSError:
        pass


def keep(folder: Path) -> int:
    """Write `KEPT` from `folder`'s TPU programs of a GiB or more that the shipped recipes' file lacks. The tiny
    model's compile in seconds and are left out, so that every run still compiles with XLA:TPU, a refusal
    included."""
    from tunix_pipeline.planning import compiled_figures

    shipped = compiled_figures.shipped()["figures"]
    figures = {}
    for path in sorted(folder.glob("*.json")):
        entry = json.loads(path.read_text())
        if path.stem not in shipped and entry.get("platform") == "tpu" and entry["peak"] >= 2**30:
            figures[path.stem] = entry
    lines = ",\n".join(f"  {json.dumps(k)}: {json.dumps(v)}" for k, v in figures.items())
    KEPT.write_text(f'{{"versions": {json.dumps(compiled_figures.versions())},\n "figures": {{\n{lines}\n}}}}\n')
    return len(figures)


if __name__ == "__main__":
    print(f"{keep(Path(sys.argv[1]))} programs' figures written to {KEPT}")
