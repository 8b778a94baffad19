"""The package stays legible: no import cycle between its modules, no module over ~400 lines, no function over ~60
(the project's rules, with a little slack so a docstring line does not fail the build)."""

import ast
from pathlib import Path

PACKAGE = Path(__file__).parents[1] / "src" / "tunix_pipeline"
MAX_MODULE_LINES = 420
MAX_FUNCTION_LINES = 66


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_at_load(path: Path, modules: set[str]) -> set[str]:
    """Our modules that `path` imports when it is loaded (module level; imports inside functions are lazy)."""
    found = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("tunix_pipeline"):
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return found & modules


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


def test_no_import_cycle():
    files = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph = {name: imports_at_load(path, set(files)) - {name} for name, path in files.items()}
    assert cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]  # the check itself finds one
    assert cycle(graph) is None, f"import cycle: {' -> '.join(cycle(graph))}"


def test_modules_and_functions_stay_short():
    long_modules, long_functions = [], []
    for path in sorted(PACKAGE.rglob("*.py")):
        text = path.read_text()
        if text.count("\n") > MAX_MODULE_LINES:
            long_modules.append(f"{path.relative_to(PACKAGE)} ({text.count(chr(10))} lines)")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    long_functions.append(f"{path.relative_to(PACKAGE)}:{node.name} ({lines} lines)")
    assert not long_modules, f"split these modules by job: {long_modules}"
    assert not long_functions, f"split these functions: {long_functions}"
