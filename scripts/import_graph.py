"""The import graph of titan_lightning, read with ast (nothing is imported): its circles and its
arrows running up the rooms' order, type-only imports (``if TYPE_CHECKING:``) counted.

    python scripts/import_graph.py [PACKAGE_DIR]   # prints both; exit status 1 if there is either

An arrow is an import at module level, or under ``if TYPE_CHECKING:`` (a type names its module
as surely as a call does). An import inside a function is left out: it runs late on purpose (an
optional dependency, the start-up time of an entry point), and test_imports.py asks each one to
say why. A circle is a set of modules that reach each other (a strongly connected component).
An arrow runs up when it goes to a room on a later line of LAYERS (below: the rooms, lowest first).
"""

import ast
import functools
import sys
from pathlib import Path
from typing import Iterator, NamedTuple, Optional

PACKAGE = Path(__file__).resolve().parents[1] / "titan_lightning"
NAME = PACKAGE.name

# Lowest first. A module belongs to the longest room listed here that holds it ("" is __init__.py
# alone). Rooms on one line are one layer: they may import each other (never in a circle), and
# nothing on a line below may import them.
LAYERS: list[tuple[str, ...]] = [
    ("config", "_compat", "steps", "flags", "run"),  # dataclasses and rules; Lightning's private names; a Run
    ("parallel", "checkpoint", "optim"),  # one file per parallelism and the contracts; checkpoint files; AdamW
    ("models.common", "lora"),  # a model's building blocks (CP attention and the loss use parallel/); adapters
    ("data",),  # tokenizer and datasets
    ("models", "objectives"),  # the families and their LightningModule; losses beyond next-token (preference)
    ("pretrained",),  # Hugging Face folders
    ("callbacks",),  # the Trainer's callbacks
    ("strategies",),  # Lightning glue
    ("trainer", "device_defaults", "estimate", "generate"),  # a Run -> a Trainer; the commands' bodies
    ("recipe",),  # loading and running recipes, what recipes share
    ("cli",),  # the command line
    ("testing",),  # the test system's runners (they run the command line)
    ("entry", ""),  # the console script; the package's lazy exports
]


def modules(package: Path = PACKAGE) -> dict[str, Path]:
    """Dotted name (relative to the package, "" for its __init__) -> file."""
    found = {}
    for path in sorted(package.rglob("*.py")):
        parts = list(path.relative_to(package).with_suffix("").parts)
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


@functools.cache
def parse(path: Path) -> ast.Module:
    return ast.parse(path.read_text())


def _is_type_checking(node: ast.If) -> bool:
    return ast.unparse(node.test) in ("TYPE_CHECKING", "typing.TYPE_CHECKING")


def statements(tree: ast.Module) -> Iterator[tuple[ast.stmt, str]]:
    """Every import statement, with where it runs: "module" (at import), "type-only" (under
    ``if TYPE_CHECKING:``) or "function" (when a function is called)."""

    def visit(node: ast.AST, where: str) -> Iterator[tuple[ast.stmt, str]]:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                yield child, where
            elif isinstance(child, ast.If) and where != "function" and _is_type_checking(child):
                for statement in child.body:
                    yield from visit(ast.Module(body=[statement], type_ignores=[]), "type-only")
                for statement in child.orelse:
                    yield from visit(ast.Module(body=[statement], type_ignores=[]), where)
            else:
                inside = isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
                yield from visit(child, "function" if inside else where)

    return visit(tree, "module")


def targets(node: ast.stmt, module: str, is_package: bool, known: dict[str, Path]) -> dict[str, bool]:
    """The package's modules an import statement runs (relative names resolved), each with whether
    the statement names it (False: a package above a named module)."""
    if isinstance(node, ast.Import):
        names = [alias.name for alias in node.names]
    else:
        base = node.module or ""
        if node.level:
            package = [NAME, *module.split(".")] if module else [NAME]
            package = package if is_package else package[:-1]
            base = ".".join(package[:len(package) - node.level + 1] + ([base] if base else []))
        names = [f"{base}.{alias.name}" for alias in node.names] + [base]
    own = {module.rsplit(".", n)[0] for n in range(1, module.count(".") + 1)}  # importing already
    found: dict[str, bool] = {}
    for name in names:
        if not name.startswith(NAME + "."):
            continue  # another package, or titan_lightning's __init__ (every import runs it; it imports nothing)
        name = name[len(NAME) + 1:]
        while name not in known and "." in name:
            name = name.rsplit(".", 1)[0]
        named = True
        while name in known:  # the module, then the packages above it, whose __init__ runs first
            if name != module and name not in own:
                found[name] = found.get(name, False) or named
            if "." not in name:
                break
            name, named = name.rsplit(".", 1)[0], False
    return found


class Arrow(NamedTuple):
    type_only: bool  # every import of it sits under ``if TYPE_CHECKING:``
    named: bool  # some import names it (else only a package above a named module: its __init__ runs)


def graph(known: Optional[dict[str, Path]] = None) -> dict[str, dict[str, Arrow]]:
    """module -> {imported module: Arrow}."""
    known = modules() if known is None else known
    edges: dict[str, dict[str, Arrow]] = {}
    for module, path in known.items():
        edges[module] = {}
        for node, where in statements(parse(path)):
            if where == "function":
                continue
            for target, named in targets(node, module, path.name == "__init__.py", known).items():
                before = edges[module].get(target, Arrow(True, False))
                edges[module][target] = Arrow(before.type_only and where == "type-only", before.named or named)
    return edges


def circles(edges: dict[str, dict[str, Arrow]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def connect(module: str) -> None:
        index[module] = low[module] = len(index)
        stack.append(module)
        for target in edges[module]:
            if target not in index:
                connect(target)
                low[module] = min(low[module], low[target])
            elif target in stack:
                low[module] = min(low[module], index[target])
        if low[module] == index[module]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == module:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for module in sorted(edges):
        if module not in index:
            connect(module)
    return sorted(found)


def layer(module: str) -> int:
    """The module's layer in LAYERS (the longest room that holds it)."""
    best, level = -1, None
    for n, rooms in enumerate(LAYERS):
        for room in rooms:
            holds = module == room or (room != "" and module.startswith(room + "."))
            if holds and len(room) > best:
                best, level = len(room), n
    if level is None:
        raise ValueError(f"{_name(module)} is in no room of LAYERS (scripts/import_graph.py): add its room "
                         f"to the line of the rooms it may import and that import it")
    return level


def upward(edges: dict[str, dict[str, Arrow]]) -> list[tuple[str, str, Arrow]]:
    """(importer, imported, arrow) for each named import of a module in a higher layer."""
    return [(module, target, arrow) for module in sorted(edges) for target, arrow in sorted(edges[module].items())
            if arrow.named and layer(target) > layer(module)]


def _name(module: str) -> str:
    return f"{NAME}.{module}" if module else NAME


def report(edges: dict[str, dict[str, Arrow]]) -> tuple[list[str], int, int]:
    """The lines to print, the number of circles and of upward arrows."""
    found, up = circles(edges), upward(edges)
    lines = [f"circle: {' <-> '.join(_name(m) for m in members)}" for members in found]
    lines += [f"upward: {_name(a)} -> {_name(b)}" + (" (type-only)" if arrow.type_only else "") for a, b, arrow in up]
    lines.append(f"{len(found)} circle(s), {len(up)} upward arrow(s), type-only imports counted "
                 f"({sum(map(len, edges.values()))} arrows among {len(edges)} modules)")
    return lines, len(found), len(up)


def main(argv: list[str]) -> int:
    if argv in (["-h"], ["--help"]):
        print(__doc__)
        return 0
    if argv and (len(argv) > 1 or argv[0].startswith("-") or not (Path(argv[0]) / "__init__.py").is_file()):
        print(f"usage: python scripts/import_graph.py [PACKAGE_DIR] (a folder with an __init__.py; default "
              f"{PACKAGE}); got {' '.join(argv)!r}", file=sys.stderr)
        return 2
    lines, n_circles, n_up = report(graph(modules(Path(argv[0]) if argv else PACKAGE)))
    print("\n".join(lines))
    return 1 if n_circles or n_up else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
