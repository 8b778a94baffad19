"""What XLA said of a program, kept by the program's own text: a plan compiled again (the plan pipeline, then
the sft preflight of the run it planned; a second plan after a change elsewhere) reads the figures instead of
compiling the same program for minutes.

The key is everything the compiled figures depend on: the lowered StableHLO (shapes, dtypes, shardings, the
mesh, donations), the compiler options, the devices (platform, kind, count, coordinates) and the versions of
JAX, jaxlib and libtpu. The same key is the same compile, so a figure read back is the figure XLA would
give again; a program XLA:TPU refuses for memory is kept as that refusal. Other failures are not kept.

The figures live beside JAX's persistent compilation cache, in `<jax_compilation_cache_dir>/xla-figures/`,
when one is set (JAX_COMPILATION_CACHE_DIR), and otherwise in the machine's temporary folder
(`tunix-pipeline-xla-figures/`): a few hundred bytes a program, so the sft preflight of `kedro run` after
`kedro run --pipelines=plan` in the same session reads back what the plan compiled (minutes of XLA:TPU) without a
cache of executables on the session's disk. A TPU topology's programs compiled on compile-only devices cannot be
read back from JAX's own cache (`xla._unpersisted`), their figures can. An unreadable entry is compiled again; a
folder that cannot be written keeps them for the process.

The shipped recipes' XLA:TPU programs come with their figures (`shipped_xla_figures.json`, read last): their plan on
a fresh machine reads them instead of compiling for minutes, under the same key, so a recipe changed in any setting
the program depends on, another compiler version or another program compiles as before. After a change to what the
recipes compile, `python -m tunix_pipeline.planning.compiled_figures` plans each TPU recipe with an empty folder
and writes the file anew from what XLA:TPU gave (`tests/test_recipes.py` fails while it is stale).
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import jax
import jaxlib

_IN_PROCESS: dict[str, dict] = {}
SHIPPED = Path(__file__).with_name("shipped_xla_figures.json")
_OFF = "TUNIX_PIPELINE_SHIPPED_FIGURES_OFF"  # set by `ship` for the plans it runs
REFUSED = "Ran out of memory"  # XLA:TPU's refusal of a program over the chip's memory: as stable as a figure


class Refused(RuntimeError):
    """XLA:TPU's refusal read back (the message as XLA gave it)."""


def versions() -> dict:
    """The compilers a figure depends on: another version is another key."""
    try:
        libtpu = importlib.metadata.version("libtpu")
    except importlib.metadata.PackageNotFoundError:
        libtpu = None
    return {"jax": jax.__version__, "jaxlib": jaxlib.__version__, "libtpu": libtpu}


def key(lowered, compiler_options: dict | None, devices) -> str:
    head = {
        **versions(),
        "options": sorted((compiler_options or {}).items()),
        "devices": [[d.platform, d.device_kind, str(getattr(d, "coords", None)),
                     getattr(d, "core_on_chip", None)] for d in devices],
    }
    digest = hashlib.sha256(json.dumps(head, sort_keys=True, default=str).encode())
    digest.update(lowered.as_text().encode())
    return digest.hexdigest()


def method(how: str, *parts: dict) -> str:
    """`how` the figures were had, saying when every compile was read back rather than run."""
    return f"{how}; read back from the same program's compile" if all(p.get("compiled_before") for p in parts) else how


def _folder() -> Path:
    root = jax.config.jax_compilation_cache_dir
    return Path(root) / "xla-figures" if root else Path(tempfile.gettempdir()) / "tunix-pipeline-xla-figures"


def read(entry: str) -> dict | None:
    """The figures kept for `entry`; raises `Refused` for a kept refusal; None when nothing (readable) is kept."""
    figures = _IN_PROCESS.get(entry)
    if figures is None:
        try:
            figures = json.loads((_folder() / f"{entry}.json").read_text())
        except (OSError, ValueError):
            figures = shipped()["figures"].get(entry)
    if figures is None:
        return None
    if "refused" in figures:
        raise Refused(figures["refused"])
    return dict(figures)


def write(entry: str, figures: dict) -> None:
    """Keep `figures` (or `{"refused": message}`) for `entry`; a folder that cannot be written keeps it in memory."""
    _IN_PROCESS[entry] = dict(figures)
    folder = _folder()
    tmp = None
    try:
        folder.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=folder, suffix=".tmp")
        with os.fdopen(fd, "w") as f:
            json.dump(figures, f)
        os.replace(tmp, folder / f"{entry}.json")  # whole or absent: another process may read it now
    except OSError:  # a full disk, a read-only cache: the figures stay in this process
        if tmp is not None:
            Path(tmp).unlink(missing_ok=True)


@functools.cache
def shipped() -> dict:
    """The shipped recipes' figures: `{"versions": ..., "figures": {key: figures}}` (nothing when absent, or off while
    `ship` compiles them anew)."""
    try:
        if not os.environ.get(_OFF):
            return json.loads(SHIPPED.read_text())
    except (OSError, ValueError):
        pass
    return {"versions": {}, "figures": {}}


def ship(recipes: list[str], project: Path, keep: dict | None = None) -> dict:
    """Plan each of `recipes` (`kedro run --pipelines=plan --env R`) with one empty figures folder, no JAX cache and
    the shipped figures off, and write what XLA:TPU gave them, beside `keep`, to `SHIPPED` (CPU programs are this
    machine's: never shipped). A program two recipes share is compiled once."""
    figures = dict(keep or {})
    with tempfile.TemporaryDirectory() as tmp:
        env = {k: v for k, v in os.environ.items() if k not in ("JAX_COMPILATION_CACHE_DIR", "XLA_FLAGS")}
        env.update(TMPDIR=tmp, **{_OFF: "1"})
        for recipe in recipes:
            subprocess.run([str(Path(sys.executable).with_name("kedro")), "run", "--pipelines=plan", "--env", recipe,
                            "--params", f"runtime.output_root={Path(tmp, recipe)}"], cwd=project, env=env, check=True)
        for path in Path(tmp, "tunix-pipeline-xla-figures").glob("*.json"):
            kept = json.loads(path.read_text())
            if kept.get("platform") == "tpu" or "refused" in kept:
                figures[path.stem] = kept
    return write_shipped(figures)


def write_shipped(figures: dict) -> dict:
    """`SHIPPED` holding `figures` under this process's compiler versions, a program a line."""
    out = {"versions": versions(), "figures": dict(sorted(figures.items()))}
    lines = ",\n".join(f"  {json.dumps(k)}: {json.dumps(v)}" for k, v in out["figures"].items())
    tmp = SHIPPED.with_suffix(".tmp")
    tmp.write_text(f'{{"versions": {json.dumps(out["versions"])},\n "figures": {{\n{lines}\n}}}}\n')
    os.replace(tmp, SHIPPED)  # whole or as it was: a plan may read it now
    return out


if __name__ == "__main__":
    TPU_RECIPES = ["tpu_full", "qwen05b_v5e8", "v4_64_pod", "kaggle_gemma3_1b_v5e8", "kaggle_gemma3_1b_judge_v5e8",
                   "kaggle_gemma2_2b_v5e8"]
    # named recipes are planned again beside what is shipped; none named: every TPU recipe, the file made anew
    shipped_now = ship(sys.argv[1:] or TPU_RECIPES, Path.cwd(), shipped()["figures"] if sys.argv[1:] else None)
    print(f"{len(shipped_now['figures'])} programs' figures written to {SHIPPED}")
