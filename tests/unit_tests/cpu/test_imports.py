"""The package's imports, read statically (ast, nothing imported): no module of titan_lightning
imports itself back through others at module level, and an import of titan_lightning inside a
function says why it is there (a comment on its line or just above: an optional dependency, the
start-up time of a light entry point, ...)."""

import ast
import functools
from pathlib import Path

import titan_lightning

PACKAGE = Path(titan_lightning.__file__).parent
NAME = PACKAGE.name


def _modules() -> dict[str, tuple[Path, bool]]:
    """Dotted name -> (file, is a package's __init__)."""
    modules = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        is_package = parts[-1] == "__init__"
        modules[".".join(parts[:-1] if is_package else parts)] = (path, is_package)
    return modules


MODULES = _modules()


def _known(name: str) -> str:
    while name not in MODULES and "." in name:
        name = name.rsplit(".", 1)[0]
    return name


def _targets(node: ast.Import | ast.ImportFrom, module: str, is_package: bool) -> list[str]:
    """The first-party modules an import statement runs: each named module and the packages above
    it that ``module`` does not already sit in (those are importing already)."""
    if isinstance(node, ast.Import):
        names = [alias.name for alias in node.names]
    else:
        base = node.module or ""
        if node.level:
            package = module.split(".") if is_package else module.split(".")[:-1]
            base = ".".join(package[:len(package) - node.level + 1] + ([base] if base else []))
        names = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in MODULES else base for alias in node.names]
    own = {module.rsplit(".", n)[0] for n in range(1, module.count(".") + 1)}
    targets = []
    for name in names:
        if name != NAME and not name.startswith(NAME + "."):
            continue
        name = _known(name)
        while name != NAME:
            if name not in own and name != module:
                targets.append(name)
            name = name.rsplit(".", 1)[0]
    return targets


def _is_type_checking(node: ast.If) -> bool:
    return ast.unparse(node.test) in ("TYPE_CHECKING", "typing.TYPE_CHECKING")


@functools.cache
def _imports(module: str) -> tuple[frozenset[str], list[tuple[int, ast.stmt]]]:
    """(first-party modules imported at module level, first-party import statements inside functions)."""
    path, is_package = MODULES[module]
    top: set[str] = set()
    inner: list[tuple[int, ast.stmt]] = []

    def visit(node: ast.AST, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                targets = _targets(child, module, is_package)
                if in_function and targets:
                    inner.append((child.lineno, child))
                elif not in_function:
                    top.update(targets)
            elif isinstance(child, ast.If) and _is_type_checking(child) and not in_function:
                for statement in child.orelse:  # the body never runs
                    visit(ast.Module(body=[statement], type_ignores=[]), in_function)
            else:
                visit(child, in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)))

    visit(ast.parse(path.read_text()), False)
    return frozenset(top), inner


GRAPH = {module: set(_imports(module)[0]) for module in MODULES}


def _cycle() -> list[str] | None:
    """One cycle of GRAPH as the list of modules around it (the first repeated at the end), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def walk(module: str) -> list[str] | None:
        state[module] = 1
        path.append(module)
        for target in sorted(GRAPH[module]):
            if state.get(target) == 1:
                return path[path.index(target):] + [target]
            if target not in state and (found := walk(target)):
                return found
        path.pop()
        state[module] = 2
        return None

    for module in sorted(GRAPH):
        if module not in state and (found := walk(module)):
            return found
    return None


def _has_reason(lines: list[str], node: ast.stmt) -> bool:
    """A comment on one of the statement's lines, or on the nearest line above that is no import."""
    if any("#" in lines[n - 1] for n in range(node.lineno, node.end_lineno + 1)):
        return True
    above = node.lineno - 2
    while above >= 0 and lines[above].strip().startswith(("from ", "import ")):
        above -= 1
    return above >= 0 and lines[above].strip().startswith("#")


def test_the_import_graph_is_read_from_every_module():
    # The reader sees what it must: a sample of known module-level imports, relative ones included.
    assert "titan_lightning.config.validation" in GRAPH["titan_lightning.config"]
    assert "titan_lightning.parallel.contracts" in GRAPH["titan_lightning.models.causal_lm"]
    assert "titan_lightning.callbacks.weights" in GRAPH["titan_lightning.recipe"]
    assert len(GRAPH) > 80


def test_no_module_imports_itself_back_at_module_level():
    cycle = _cycle()
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_a_cycle_is_found_and_named():
    saved = GRAPH["titan_lightning.config.job"]
    GRAPH["titan_lightning.config.job"] = saved | {"titan_lightning.recipe"}
    try:
        cycle = _cycle()
    finally:
        GRAPH["titan_lightning.config.job"] = saved
    assert cycle is not None and cycle[0] == cycle[-1]
    assert "titan_lightning.config.job" in cycle and "titan_lightning.recipe" in cycle


def test_every_import_of_the_package_inside_a_function_says_why():
    unexplained, count = [], 0
    for module, (path, _) in MODULES.items():
        lines = path.read_text().splitlines()
        for lineno, node in _imports(module)[1]:
            count += 1
            if not _has_reason(lines, node):
                unexplained.append(f"{path.relative_to(PACKAGE.parent)}:{lineno}: {ast.unparse(node)}")
    assert not unexplained, ("a first-party import inside a function needs a comment saying why (an optional "
                             "dependency, start-up time, a cycle that needs a redesign: name it), or belongs "
                             "at the top:\n" + "\n".join(unexplained))
    # 8 when this test was written, and 3 in titan_lightning/entry.py (the console script, whose point is to
    # import the heavy modules only for the commands that need them).
    assert count <= 11, f"{count} first-party imports inside functions (11 when this test was last set): move them up"
