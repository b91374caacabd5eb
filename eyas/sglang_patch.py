"""The patch stage: make the server host able to dump hidden states.

The local backend (eyas serve-local) writes dumps natively, so nothing is patched there. For SGLang
hosts this module reads the installed version; installing the versioned hook from
patches/sglang/<version>/ is the job of the server-lifecycle work (docs/architecture.md).
"""

from __future__ import annotations

import shlex

from eyas.config import PipelineConfig
from eyas.hosts import Host


class PatchError(RuntimeError):
    """The server host is in a state eyas will not patch; names the file or version."""


def sglang_version(host: Host, python: str) -> str | None:
    """The sglang version importable by `python` on the host, or None."""
    code = "import importlib.metadata as m; print(m.version('sglang'))"
    r = host.run(f"{shlex.quote(python)} -c {shlex.quote(code)}", check=False, timeout=60)
    return r.stdout.strip() if r.ok else None


def ensure_patched(host: Host, cfg: PipelineConfig) -> dict:
    """Bring the host to the patched state the config needs; returns what was found and done."""
    if cfg.server.backend == "local":
        return {"backend": "local", "host": host.name, "status": "not needed",
                "reason": "eyas serve-local writes hidden-state dumps itself"}
    version = sglang_version(host, cfg.server.python or "python3")
    if version is None:
        raise PatchError(f"[{host.name}] sglang is not importable by {cfg.server.python}")
    raise PatchError(f"[{host.name}] sglang {version}: no patch set is installed by this eyas version yet "
                     f"(see patches/README.md)")
