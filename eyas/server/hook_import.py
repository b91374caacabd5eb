"""Does the hook import in the server's python? Asked before the patch stage writes anything.

    check_modules_import(host, "/opt/sglang/bin/python", {"CUDA_HOME": ...}, pset.modules)

The modules about to be installed go to a temporary folder on the host, and the server's own
python, with server.env, imports the hook from there as SGLang will. A module that needs something
SGLang's python lacks (eyas itself, say) is refused in seconds, naming the missing module, instead
of failing in every TP rank after a ten-minute model load.
"""

from __future__ import annotations

import json
import shlex
import tempfile
from pathlib import Path

from eyas.remote import source
from eyas.server.hosts import Host
from eyas.server.patch_sets import PatchError


def check_modules_import(
    host: Host, python: str, env: dict[str, str] | None, modules: dict[str, bytes]
) -> None:
    """Refuse (PatchError naming the missing module) a hook that `python` on the host cannot
    import."""
    staging = host.run("mktemp -d /tmp/eyas-hook-check.XXXXXX", timeout=30).stdout.strip()
    try:
        with tempfile.TemporaryDirectory(prefix="eyas-patch-") as tmp:
            for name, data in modules.items():
                (Path(tmp) / name).write_bytes(data)
                host.put(Path(tmp) / name, f"{staging}/{name}")
        cmd = " ".join(shlex.quote(a) for a in [python, "-c", source("hook_import"), staging])
        r = host.run(cmd, check=False, timeout=300, env=env)
    finally:
        host.remove_tree(staging)
    try:
        result = json.loads(r.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        raise PatchError(
            f"[{host.name}] {python} could not run the hook import check (exit {r.exit_code}): "
            f"{(r.stderr or r.stdout).strip()[-1000:]}"
        ) from None
    if result["error"]:
        missing = f" (module {result['missing']!r} is missing there)" if result["missing"] else ""
        raise PatchError(
            f"[{host.name}] the eyas hook does not import in the server's python {python}"
            f"{missing}: {result['error']}; nothing was installed"
        )
