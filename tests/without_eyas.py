"""A python where `eyas` cannot be imported, as on a GPU host whose SGLang python has no eyas.

    env = {"PYTHONPATH": f"{without_eyas(tmp)}:{site}"}   # any python started with it

The folder holds a sitecustomize.py (Python imports it at start-up from sys.path) that puts a
finder in front of sys.meta_path refusing `eyas` and its submodules, whatever else is installed:
this project's venv has eyas installed in editable mode, so a plain python here would import it.
"""

from __future__ import annotations

from pathlib import Path

SITECUSTOMIZE = """
import importlib.abc, sys


class _NoEyas(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "eyas" or name.startswith("eyas."):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None


sys.meta_path.insert(0, _NoEyas())
"""


def without_eyas(root: Path) -> Path:
    """A folder to put first on PYTHONPATH so that the python started with it cannot import eyas."""
    folder = Path(root) / "without-eyas"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "sitecustomize.py").write_text(SITECUSTOMIZE)
    return folder
