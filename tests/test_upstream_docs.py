"""docs/upstream_tunix.md names only code that exists: ours, Tunix's and JAX's (a Tunix upgrade that renames what an
entry works around fails here), and every public name of `tunix_pipeline.upstream` has its entry."""

import importlib
import re
from pathlib import Path

import pytest

from tunix_pipeline import upstream

ROOT = Path(__file__).parents[1]
DOC = (ROOT / "docs/upstream_tunix.md").read_text()
PACKAGE = ROOT / "src/tunix_pipeline"
FOLDERS = ("", "core", "data", "evaluate", "generate", "models", "models/families", "planning", "run", "tracking", "train",
           "upstream")
OURS = {p.stem for folder in FOLDERS for p in (PACKAGE / folder).glob("*.py")} | {f.rpartition("/")[2] for f in FOLDERS if f}
PACKAGES = tuple(f"tunix_pipeline.{folder.replace('/', '.')}." if folder else "tunix_pipeline." for folder in FOLDERS)
CODE = re.compile(r"`([A-Za-z_][\w]*(?:\.[\w]+)+)(?:\(\))?`")
TEST = re.compile(r"`(tests/[\w/]+\.py)(?:::(\w+))?`")


def resolve(dotted: str):
    """The object `dotted` names, trying each of our packages for a short name; None if nothing has it."""
    prefixes = ("",) if dotted.split(".")[0] in ("tunix", "jax", "flax", "optax") else PACKAGES
    for prefix in prefixes:
        parts = (prefix + dotted).split(".")
        for cut in range(len(parts), 0, -1):
            try:
                obj = importlib.import_module(".".join(parts[:cut]))
            except ImportError:
                continue
            try:
                for name in parts[cut:]:
                    obj = getattr(obj, name)
                return obj
            except AttributeError:
                break
    return None


def config_field(dotted: str) -> bool:
    """`grpo.algorithm`-style names are settings: a field of that section's model (`GrpoParams`)."""
    from tunix_pipeline import config

    section, *fields = dotted.split(".")
    model = getattr(config, f"{section.title()}Params", None)
    for name in fields:
        if model is None or name not in getattr(model, "model_fields", {}):
            return False
        model = model.model_fields[name].annotation
    return True


FILES = (".json", ".py", ".md", ".safetensors", ".gguf")
NAMES = sorted({m for m in CODE.findall(DOC) if m.split(".")[0] in OURS | {"tunix", "jax"} and not m.endswith(FILES)})


def test_the_doc_names_code():
    assert len(NAMES) > 30 and any(n.startswith("tunix.") for n in NAMES) and any(n.startswith("upstream.") for n in NAMES)


@pytest.mark.parametrize("name", NAMES)
def test_every_name_in_the_doc_exists(name):
    assert resolve(name) is not None or config_field(name), \
        f"docs/upstream_tunix.md names `{name}`, which no longer exists: update the entry (or drop it)"


def test_every_test_the_doc_names_exists():
    found = TEST.findall(DOC)
    assert found
    for path, name in found:
        assert (ROOT / path).exists(), f"docs/upstream_tunix.md names {path}, which does not exist"
        if name:
            assert f"def {name}(" in (ROOT / path).read_text(), f"docs/upstream_tunix.md names {path}::{name}"


def test_every_workaround_in_upstream_has_its_entry():
    public = [n for n, v in vars(upstream).items() if not n.startswith("_") and callable(v)
              and getattr(v, "__module__", "").startswith(upstream.__name__)]  # the package and its modules
    assert public
    missing = [n for n in public if f"`upstream.{n}`" not in DOC]
    assert not missing, f"docs/upstream_tunix.md has no entry naming {missing}"
