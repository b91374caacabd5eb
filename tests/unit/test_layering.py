"""The core (eyas/) is Prefect-free: no module under it imports Prefect, the flows or the tasks, at
the top or inside a function, by an import statement or by name through importlib / __import__. And no
import in the core runs back up a layer: a stage imports only the stages below it (import-linter
holds the same contracts in CI: pyproject.toml). No function of eyas/, tasks/ or flows/ is over 60
lines."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FORBIDDEN = ("prefect", "flows", "tasks")


def _top(name: str | None) -> str:
    return (name or "").split(".")[0]


def imports_of(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, module) for every import in the tree, wherever it stands, and every literal module name
    given to importlib.import_module or __import__."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            found.append((node.lineno, node.module or ""))
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
            f = node.func
            name = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else ""
            if name in ("import_module", "__import__") and isinstance(node.args[0].value, str):
                found.append((node.lineno, node.args[0].value))
    return sorted(found)


def test_the_core_imports_nothing_of_prefect_flows_or_tasks():
    files = sorted((ROOT / "eyas").rglob("*.py"))
    assert len(files) > 40  # the walk found the core
    bad = [f"{path.relative_to(ROOT)}:{line}: {module}"
           for path in files for line, module in imports_of(ast.parse(path.read_text(), str(path)))
           if _top(module) in FORBIDDEN]
    assert not bad, "the core imports the Prefect layer:\n" + "\n".join(bad)


def test_the_walk_sees_imports_inside_functions_and_by_name():
    source = ("def f():\n    from prefect import flow\n"
              "def g():\n    import flows.pipeline\n"
              "importlib.import_module('tasks.extract')\n__import__('prefect.runtime')\n"
              "from eyas.config import load_config\nfrom . import sibling\n")
    assert [m for _, m in imports_of(ast.parse(source))] == ["prefect", "flows.pipeline", "tasks.extract",
                                                             "prefect.runtime", "eyas.config"]


#: The core's layers, lowest first: a module imports only its own package and packages of its layer
#: or below (the stages in DAG order; what assembles stages last).
LAYERS = [
    {"errors", "files", "net", "resources", "secrets"},
    {"config", "dump", "draft_format", "target"},
    {"server"},
    {"extraction"},
    {"training"},
    {"evaluation"},
    {"local", "plan", "preflight", "results", "report", "cli", "__main__"},
]
RANK = {name: i for i, layer in enumerate(LAYERS) for name in layer}


def eyas_imports(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, first name under eyas) of every import of the core, `from eyas import x` naming x."""
    found = []
    for line, module in imports_of(tree):
        parts = module.split(".")
        if parts[0] == "eyas" and len(parts) > 1:
            found.append((line, parts[1]))
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module == "eyas":
            found += [(node.lineno, a.name) for a in node.names]
    return found


def test_no_import_in_the_core_runs_back_up_a_layer():
    files = sorted((ROOT / "eyas").rglob("*.py"))
    packages = {p.relative_to(ROOT / "eyas").parts[0].removesuffix(".py") for p in files} - {"__init__", "_shipped"}
    assert packages <= set(RANK), f"place these in LAYERS: {sorted(packages - set(RANK))}"
    bad = []
    for path in files:
        rel = path.relative_to(ROOT / "eyas").parts
        own = rel[0].removesuffix(".py")
        if own not in RANK:
            continue
        for line, name in eyas_imports(ast.parse(path.read_text(), str(path))):
            if name != own and RANK.get(name, -1) > RANK[own]:
                bad.append(f"eyas/{'/'.join(rel)}:{line}: {own} imports {name}")
    assert not bad, "imports that run back up a layer:\n" + "\n".join(bad)


def test_the_layer_check_sees_an_upward_import():
    tree = ast.parse("def f():\n    from eyas.evaluation.evaluate import x\nfrom eyas import resources\n")
    assert eyas_imports(tree) == [(2, "evaluation"), (3, "resources")]
    assert RANK["evaluation"] > RANK["training"]


#: Lines a function of eyas/, flows/ or tasks/ may take, its docstring not counted
MAX_FUNCTION_LINES = 60


def long_functions(tree: ast.AST) -> list[tuple[int, str, int]]:
    """(line, name, lines) of every function longer than MAX_FUNCTION_LINES without its docstring,
    unless the comment line right above its def (or its decorators) says why (`# long: ...`)."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            lines = node.end_lineno - node.lineno + 1
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str):
                lines -= first.end_lineno - first.lineno + 1
            if lines > MAX_FUNCTION_LINES:
                found.append((node.lineno, node.name, lines))
    return found


def test_no_function_of_the_code_is_over_60_lines():
    """Small functions, one idea each (ruff's complexity limit is the other half: pyproject.toml)."""
    long = []
    for folder in ("eyas", "tasks", "flows"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            source = path.read_text().splitlines()
            for line, name, n in long_functions(ast.parse("\n".join(source), str(path))):
                if not source[line - 2].strip().startswith("# long:"):
                    long.append(f"{path.relative_to(ROOT)}:{line} {name}: {n} lines")
    assert not long, "split these, or say why above the def (# long: ...):\n" + "\n".join(long)


def test_the_length_check_leaves_out_the_docstring():
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_FUNCTION_LINES - 1))
    doc = '    """' + "\n".join(["doc"] * 10) + '"""\n'
    assert long_functions(ast.parse("def f():\n" + doc + body + "\n")) == []
    assert long_functions(ast.parse("def f():\n" + body + "\n    y = 1\n    z = 2\n")) == [(1, "f", MAX_FUNCTION_LINES + 2)]
