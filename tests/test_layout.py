"""The package stays legible: its packages in layers, each importing only those below it (imports inside functions
count too), no import cycle between its modules, few imports inside functions (each for an optional dependency or a
light start of Kedro's CLI), only the modules above the pipelines import them, no pipeline imports another, modules
in packages by concern. Sizes and names are review guidance (CONTRIBUTING.md), not tests."""

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).parents[1] / "src" / "tunix_pipeline"


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_nodes(tree: ast.AST):
    """Every import statement, at load and inside functions, but not those under `if TYPE_CHECKING:` (annotations
    only, never run)."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.If) and getattr(node.test, "id", None) == "TYPE_CHECKING":
            continue
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        yield from import_nodes(node)


def imports(path: Path, modules: set[str]) -> set[str]:
    """Our modules that `path` imports anywhere: at load and inside functions (an import moved into a function
    hides a circle, it does not remove it). Importing a package is an edge to its `__init__`, named as the package."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in import_nodes(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            # `from . import x` / `from ..y import z`: relative to the importing module's package
            base = package.rsplit(".", node.level - 1)[0] if node.level else ""
            source = ".".join(part for part in (base, node.module) if part)
            # `from pkg import module` is an edge to the module; `from pkg import name`, to the package's `__init__`
            found.update(f"{source}.{a.name}" if f"{source}.{a.name}" in modules else source for a in node.names)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return found & modules


def package_graph() -> dict[str, set[str]]:
    files = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    return {name: imports(path, set(files)) - {name} for name, path in files.items()}


def cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle, as the modules along it, or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(name, path):
        state[name] = 1
        for dep in sorted(graph[name]):
            if state.get(dep) == 1:
                return path[path.index(dep):] + [dep] if dep in path else [name, dep]
            if dep not in state and (found := visit(dep, path + [dep])):
                return found
        state[name] = 2
        return None

    for name in sorted(graph):
        if name not in state and (found := visit(name, [name])):
            return found
    return None


def test_import_edges_include_lazy_and_relative_imports():
    graph = package_graph()
    assert "tunix_pipeline.pipelines.sft.pipeline" in graph["tunix_pipeline.pipelines.sft"]  # `from .pipeline import`
    assert "tunix_pipeline.evaluate.harness_lm" in graph["tunix_pipeline.evaluate.harness"]  # imported inside a function
    assert "tunix_pipeline.config" not in graph["tunix_pipeline.core.runtime"]  # under `if TYPE_CHECKING:` only


def test_no_import_cycle():
    graph = package_graph()
    assert cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]  # the check itself finds one
    assert cycle(graph) is None, f"import cycle: {' -> '.join(cycle(graph))}"


# The packages bottom to top (the README's layout, read upwards): each imports only its own layer and those below.
LAYERS = (
    {"core", "stages"},  # errors, paths, processes, runtime and mesh, progress, quieting; the stage registry (a leaf)
    {"config"},
    {"tracking"},
    {"upstream"},
    {"data"},
    {"models"},
    {"generate"},  # the sampler: stages and the evaluation generate through it
    {"train"},
    {"evaluate"},
    {"planning"},
    {"run"},  # what runs the pipeline: hooks, preflight, sessions, the config loader
    {"pipelines"},
    {"__init__", "__main__", "cli", "pipeline_registry", "settings"},  # Kedro's entry points
)


def layer_of(name: str) -> int:
    part = (name.split(".") + ["__init__"])[1]
    return next(i for i, layer in enumerate(LAYERS) if part in layer)


def test_no_package_imports_one_above_it():
    assert layer_of("tunix_pipeline") == layer_of("tunix_pipeline.cli") > layer_of("tunix_pipeline.run.hooks")
    upward = sorted(f"{name} -> {dep}" for name, deps in package_graph().items() for dep in deps
                    if layer_of(dep) > layer_of(name))
    assert not upward, f"imports of a layer above (tests/test_layout.py: LAYERS): {upward}"


# What an import inside a function may load: optional dependencies, which a run without their extra never needs
OPTIONAL = ("lm_eval", "tunix_pipeline.evaluate.harness_lm", "fsspec", "google.cloud", "kagglehub")
# what Kedro's CLI must not import for every command (`kedro --help`, a mistyped `--env`): ~10 s together
HEAVY = ("jax", "flax", "tunix", "orbax", "mlflow", "transformers", "torch", "datasets", "matplotlib")


@pytest.fixture(scope="module")
def start_up() -> set[str]:
    """Our modules that Kedro's CLI imports before any command runs: the project's settings (its hooks, the config
    loader) and CLI; asserts that none of them loads a `HEAVY` library."""
    code = ("import sys, tunix_pipeline.settings, tunix_pipeline.cli; "
            "print(' '.join(sorted(m for m in sys.modules if m.split('.')[0] in {'tunix_pipeline', *sys.argv[1:]})))")
    loaded = subprocess.run([sys.executable, "-c", code, *HEAVY], capture_output=True, text=True, check=True,
                            env={k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}).stdout.split()
    heavy = sorted({m.split(".")[0] for m in loaded} & set(HEAVY))
    assert not heavy, f"Kedro's start-up (settings.py, cli.py) imports {heavy}: import them where they are used"
    return {m for m in loaded if m.startswith("tunix_pipeline")}


def test_imports_inside_functions_are_few_and_each_for_an_optional_dependency_or_a_light_start(start_up):
    """An import inside a function hides a cycle or a slow start more often than it saves one: at most 3 per 1,000
    lines, each with its reason beside it: an optional dependency (`OPTIONAL`), or, in a module Kedro's CLI loads
    for every command (`start_up`), a heavy library kept out of that start (marked `start-up`)."""
    assert "tunix_pipeline.run.hooks" in start_up and "tunix_pipeline.train.loop" not in start_up
    found, lines = [], 0
    for path in sorted(PACKAGE.rglob("*.py")):
        text = path.read_text()
        lines += text.count("\n")
        source = text.splitlines()
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                for inner in import_nodes(node):
                    module = inner.module if isinstance(inner, ast.ImportFrom) else inner.names[0].name
                    comment = source[inner.end_lineno - 1].partition("#")[2]
                    reason = (module or "").startswith(OPTIONAL) or (
                        module_name(path) in start_up and "start-up" in comment)
                    found.append((f"{path.relative_to(PACKAGE)}:{inner.lineno}", reason and bool(comment.strip())))
    assert len(found) <= 3 * lines / 1000, f"{len(found)} imports inside functions in {lines} lines"
    unexplained = [where for where, explained in found if not explained]
    assert not unexplained, f"import these at the module's top (see this test's docstring): {unexplained}"


# the Kedro project's top: they assemble the pipelines or hook into their nodes, so they sit above them
ABOVE_PIPELINES = {"tunix_pipeline.pipeline_registry", "tunix_pipeline.settings", "tunix_pipeline.run.hooks"}


def in_pipelines(name: str) -> bool:
    return name == "tunix_pipeline.pipelines" or name.startswith("tunix_pipeline.pipelines.")


def test_only_the_project_top_imports_the_pipelines():
    offenders = {name: sorted(filter(in_pipelines, deps)) for name, deps in package_graph().items()
                 if not in_pipelines(name) and name not in ABOVE_PIPELINES and any(map(in_pipelines, deps))}
    assert not offenders, f"the pipelines sit above these modules, which must not import them: {offenders}"


def test_no_pipeline_imports_another():
    """Each pipeline package is one stage's nodes; what two stages share lives in a plain module below them."""
    def pipeline_of(name: str) -> str | None:
        parts = name.split(".")
        return parts[2] if len(parts) > 2 and parts[1] == "pipelines" else None

    offenders = {name: sorted(d for d in deps if pipeline_of(d) not in (None, pipeline_of(name)))
                 for name, deps in package_graph().items() if pipeline_of(name)}
    assert not {k: v for k, v in offenders.items() if v}, f"pipelines importing another pipeline: {offenders}"


# Kedro's own entry points (it looks for these names at the package's top) and the stage registry; everything
# else lives in the package of its concern (data, models, train, evaluate, planning, tracking, run, ...)
TOP_MODULES = {"__init__", "__main__", "cli", "pipeline_registry", "settings", "stages"}


def test_the_package_top_holds_only_kedros_entry_points_and_the_stage_registry():
    loose = sorted(p.stem for p in PACKAGE.glob("*.py") if p.stem not in TOP_MODULES)
    assert not loose, f"move these into the package of their concern: {loose}"


def test_every_stage_has_its_checks_and_every_polish_stage_its_planning_module():
    from tunix_pipeline.planning import stage_planning
    from tunix_pipeline.run.preflight import STAGE_CHECKS
    from tunix_pipeline.stages import POLISH, STAGES

    assert set(STAGE_CHECKS) == {stage.name for stage in STAGES}
    for stage in POLISH:
        module = stage_planning(stage)
        assert callable(module.add_stage) and callable(module.markdown_section), stage.name
