"""eyas/remote/: the scripts run on a host under its own python, sent as source. Each compiles, and
imports the standard library alone (the host has no eyas), besides what it exists to import."""

import ast
import json
import subprocess
import sys
from pathlib import Path

from eyas.remote import source

REMOTE = Path(__file__).resolve().parents[2] / "eyas" / "remote"
#: what a script imports on purpose, beyond the standard library
MEANT = {"hook_import": {"eyas_sglang_hook"}}


def test_every_remote_script_imports_the_standard_library_alone():
    scripts = sorted(p.stem for p in REMOTE.glob("*.py") if p.stem != "__init__")
    assert scripts == ["disk_probe", "dump_dir", "hook_import", "sglang_install"]
    for name in scripts:
        tree = ast.parse(source(name))
        imported = {
            a.name.split(".")[0]
            for n in ast.walk(tree)
            if isinstance(n, ast.Import)
            for a in n.names
        }
        imported |= {
            n.module.split(".")[0]
            for n in ast.walk(tree)
            if isinstance(n, ast.ImportFrom) and n.module
        }
        assert imported - set(sys.stdlib_module_names) - MEANT.get(name, set()) == set(), name


def test_a_script_runs_as_its_source_with_arguments(tmp_path):
    folder = tmp_path / "dump"
    out = subprocess.run(
        [sys.executable, "-c", source("dump_dir"), "prepare", str(folder), "cfg"],
        capture_output=True,
        text=True,
        check=True,
        cwd=tmp_path,
    )
    assert json.loads(out.stdout) == {"state": "created"} and (folder / ".eyas-owned").is_file()
    again = subprocess.run(
        [sys.executable, "-c", source("dump_dir"), "clean", str(folder), ""],
        capture_output=True,
        text=True,
        check=True,
        cwd=tmp_path,
    )
    assert json.loads(again.stdout) == {"state": "removed"} and not folder.exists()
