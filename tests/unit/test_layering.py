"""The core (eyas/) is Prefect-free: no module under it imports Prefect, the flows or the tasks, at
the top or inside a function, by an import statement or by name through importlib / __import__. And
no import in the core runs back up a layer: a stage imports only the stages below it (import-linter
holds the same contracts in CI: pyproject.toml, which also limits a function's length and
branching through ruff)."""

import ast
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FORBIDDEN = ("prefect", "eyas_prefect", "flows", "tasks")


def _top(name: str | None) -> str:
    return (name or "").split(".")[0]


def imports_of(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, module) for every import in the tree, wherever it stands, and every literal module
    name given to importlib.import_module or __import__."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            found.append((node.lineno, node.module or ""))
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
            f = node.func
            name = (
                f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else ""
            )
            if name in ("import_module", "__import__") and isinstance(node.args[0].value, str):
                found.append((node.lineno, node.args[0].value))
    return sorted(found)


def test_the_core_imports_nothing_of_prefect_flows_or_tasks():
    files = sorted((ROOT / "eyas").rglob("*.py"))
    assert len(files) > 40  # the walk found the core
    bad = [
        f"{path.relative_to(ROOT)}:{line}: {module}"
        for path in files
        for line, module in imports_of(ast.parse(path.read_text(), str(path)))
        if _top(module) in FORBIDDEN
    ]
    assert not bad, "the core imports the Prefect layer:\n" + "\n".join(bad)


def test_the_walk_sees_imports_inside_functions_and_by_name():
    source = (
        "def f():\n    from prefect import flow\ndef g():\n    import eyas_prefect.flows.pipeline\n"
        "importlib.import_module('eyas_prefect.tasks.extract')\n__import__('prefect.runtime')\n"
        "from eyas.config import load_config\nfrom . import sibling\n"
    )
    assert [m for _, m in imports_of(ast.parse(source))] == [
        "prefect",
        "eyas_prefect.flows.pipeline",
        "eyas_prefect.tasks.extract",
        "prefect.runtime",
        "eyas.config",
    ]


#: The core's layers, lowest first, read from pyproject.toml's import-linter contract (which lists
#: them highest first): every package of eyas/ must be placed in one.
LAYERS = [
    {name.strip().split(".")[1] for name in layer.replace(":", "|").split("|")}
    for layer in reversed(
        next(
            c
            for c in tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"][
                "contracts"
            ]
            if c["type"] == "layers"
        )["layers"]
    )
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
    packages = {p.relative_to(ROOT / "eyas").parts[0].removesuffix(".py") for p in files} - {
        "__init__",
        "_shipped",
    }
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
    tree = ast.parse(
        "def f():\n    from eyas.evaluation.evaluate import x\nfrom eyas import resources\n"
    )
    assert eyas_imports(tree) == [(2, "evaluation"), (3, "resources")]
    assert RANK["evaluation"] > RANK["training"]
