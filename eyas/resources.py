"""Files eyas ships beside its code: the SGLang patch sets, the example configs, the tiny target.

In a checkout (or an editable install) they sit at the repository root (`patches/`, `configs/`,
`fixtures/`); a wheel carries them inside the package as `eyas/_shipped/...` (pyproject.toml maps
them there), so `pip install eyas` works without the repository.
"""

from __future__ import annotations

from pathlib import Path

_PACKAGE = Path(__file__).resolve().parent


def shipped_root() -> Path:
    """The folder that holds patches/, configs/ and fixtures/: the wheel's copy, else the
    checkout."""
    inside = _PACKAGE / "_shipped"
    return inside if (inside / "patches").is_dir() else _PACKAGE.parent


def shipped(*parts: str) -> Path:
    """A shipped path, e.g. shipped("patches", "sglang") or shipped("configs",
    "local-tiny.yaml")."""
    return shipped_root().joinpath(*parts)
