"""The package's imports, read statically by scripts/import_graph.py (ast, nothing imported): no
circle and no arrow running up the rooms' order, type-only imports counted; and an import of
titan_lightning inside a function says why it is there (a comment on its line or just above: an
optional dependency, the start-up time of a light entry point, ...)."""

import ast
import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[3] / "scripts" / "import_graph.py"
_spec = importlib.util.spec_from_file_location("import_graph", SCRIPT)
import_graph = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(import_graph)

MODULES = import_graph.modules()
GRAPH = import_graph.graph(MODULES)


@pytest.fixture
def edges():
    """A copy of GRAPH a test may add arrows to."""
    return {module: dict(targets) for module, targets in GRAPH.items()}


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
    assert "config.validation" in GRAPH["config"]
    assert "parallel.contracts" in GRAPH["models.causal_lm"]
    assert "callbacks.weights" in GRAPH["recipe"]
    assert len(GRAPH) > 80


def test_imports_are_read_with_where_they_run(tmp_path):
    package = tmp_path / "titan_lightning"
    (package / "sub").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "low.py").write_text("")
    (package / "sub" / "__init__.py").write_text("")
    (package / "sub" / "typed.py").write_text("")
    (package / "sub" / "late.py").write_text("")
    (package / "sub" / "high.py").write_text(
        "from typing import TYPE_CHECKING\n"
        "from .. import low\n"
        "if TYPE_CHECKING:\n"
        "    from titan_lightning.sub.typed import Name\n"
        "def f():\n"
        "    from titan_lightning.sub import late\n"
    )
    read = import_graph.graph(import_graph.modules(package))["sub.high"]
    assert read == {"low": import_graph.Arrow(type_only=False, named=True),
                    "sub.typed": import_graph.Arrow(type_only=True, named=True)}
    # The function's import is listed for test_every_import_of_the_package_inside_a_function_says_why.
    where = [w for _, w in import_graph.statements(ast.parse((package / "sub" / "high.py").read_text()))]
    assert where == ["module", "module", "type-only", "function"]


def test_no_circle_and_no_arrow_running_up_type_only_imports_counted():
    assert import_graph.circles(GRAPH) == []
    assert import_graph.upward(GRAPH) == []


def test_a_circle_is_found_and_named(edges):
    edges["config.job"]["recipe"] = import_graph.Arrow(type_only=True, named=True)
    found = import_graph.circles(edges)
    assert len(found) == 1 and {"config.job", "recipe"} <= set(found[0])


def test_an_arrow_running_up_is_found_and_named(edges):
    edges["parallel.mesh"]["strategies.titan"] = import_graph.Arrow(type_only=True, named=True)
    assert [(a, b) for a, b, _ in import_graph.upward(edges)] == [("parallel.mesh", "strategies.titan")]


def test_a_module_in_no_room_is_named():
    with pytest.raises(ValueError, match=r"titan_lightning\.newroom\.x is in no room of LAYERS"):
        import_graph.layer("newroom.x")


def test_the_script_prints_the_counts_and_fails_on_either(tmp_path, capsys):
    assert import_graph.main([]) == 0
    assert capsys.readouterr().out.startswith("0 circle(s), 0 upward arrow(s), type-only imports counted")

    package = tmp_path / "titan_lightning"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "config.py").write_text("from titan_lightning import recipe\n")
    (package / "recipe.py").write_text("from titan_lightning import config\n")
    done = subprocess.run([sys.executable, str(SCRIPT), str(package)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 1, done.stdout + done.stderr
    assert done.stdout.splitlines() == [
        "circle: titan_lightning.config <-> titan_lightning.recipe",
        "upward: titan_lightning.config -> titan_lightning.recipe",
        "1 circle(s), 1 upward arrow(s), type-only imports counted (2 arrows among 3 modules)",
    ]


def test_every_import_of_the_package_inside_a_function_says_why():
    unexplained, count = [], 0
    for module, path in MODULES.items():
        lines = path.read_text().splitlines()
        for node, where in import_graph.statements(import_graph.parse(path)):
            if where != "function" or not import_graph.targets(node, module, path.name == "__init__.py", MODULES):
                continue
            count += 1
            if not _has_reason(lines, node):
                unexplained.append(f"{path.relative_to(import_graph.PACKAGE.parent)}:{node.lineno}: {ast.unparse(node)}")
    assert not unexplained, ("a first-party import inside a function needs a comment saying why (an optional "
                             "dependency, start-up time, a cycle that needs a redesign: name it), or belongs "
                             "at the top:\n" + "\n".join(unexplained))
    # 8 when this test was written, and 3 in titan_lightning/entry.py (the console script, whose point is to
    # import the heavy modules only for the commands that need them).
    assert count <= 11, f"{count} first-party imports inside functions (11 when this test was last set): move them up"
