"""The package stays legible: no import cycle between its modules (imports inside functions count too), only the
modules above the pipelines import them, no pipeline imports another, modules in packages by concern. Sizes and
names are review guidance (CONTRIBUTING.md), not tests."""

import ast
from pathlib import Path

PACKAGE = Path(__file__).parents[1] / "src" / "tunix_pipeline"


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path, modules: set[str]) -> set[str]:
    """Our modules that `path` imports anywhere: at load and inside functions (an import moved into a function
    hides a circle, it does not remove it). Importing a package is an edge to its `__init__`, named as the package."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
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


def test_no_import_cycle():
    graph = package_graph()
    assert cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]  # the check itself finds one
    assert cycle(graph) is None, f"import cycle: {' -> '.join(cycle(graph))}"


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
