"""Scripts eyas runs on a server or training host under that host's own python, which has no eyas:
each is a module of the standard library alone, sent as its source (`python -c SOURCE ARGS`), so
ruff, import-linter and the tests read it like any other module.

    host.run(shlex.join([python, "-c", source("disk_probe"), folder, str(nbytes)]))
"""

from __future__ import annotations

from pathlib import Path


def source(name: str) -> str:
    """The text of eyas/remote/<name>.py, to send as `python -c`'s argument."""
    return (Path(__file__).parent / f"{name}.py").read_text()
