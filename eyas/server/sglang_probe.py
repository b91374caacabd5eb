"""What an SGLang host has: one probe through the server's python, importing neither sglang nor
torch.

    # version, site-packages, state, sha256s, target arch
    found = find_install(host, cfg, patches_dir)
    sglang_version(host, python, env)               # "0.5.23", or None

The patch stage (eyas/server/sglang_patch.py) plans every write from one such probe; the launch
asks it which SGLang it starts (eyas/server/launch.py).
"""

from __future__ import annotations

import json
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path

from eyas.config import PipelineConfig, ServerConfig
from eyas.remote import sglang_install, source
from eyas.server.hosts import Host
from eyas.server.patch_sets import DUMP_MODULE, PatchError, available_versions

#: in the sglang package folder; pip uninstall leaves it behind
STATE_NAME = sglang_install.STATE


# ---------------------------------------------------------------------------------------------
# What the host has: one probe through the server's python (importing neither sglang nor torch)
# ---------------------------------------------------------------------------------------------


@dataclass
class Probe:
    python: str
    version: str | None
    package_dir: str | None
    site_dir: str | None
    state: dict | None
    sha256: dict[str, str | None]
    writable: bool
    missing_modules: list[str]
    #: {"path", and "architectures" | "missing" | "error"} when asked for; None otherwise
    target_config: dict | None = None


def server_python(server: ServerConfig) -> str:
    """The interpreter the server runs with: server.python, else this one (a local host) or
    python3."""
    return server.python or (sys.executable if server.host.kind == "local" else "python3")


def probe(
    host: Host,
    python: str,
    env: dict[str, str] | None = None,
    paths: list[str] | tuple[str, ...] = (),
    target_config: str | None = None,
) -> Probe:
    """Where sglang is installed for `python` on the host, its version, the sha256 of paths, and
    (with target_config) the `architectures` of that config.json on the host."""
    extra = ["--target-config", target_config] if target_config else []
    cmd = " ".join(shlex.quote(a) for a in [python, "-c", source("sglang_install"), *extra, *paths])
    r = host.run(cmd, check=False, timeout=120, env=env)
    if not r.ok:
        raise PatchError(
            f"[{host.name}] cannot run {python} to look for sglang "
            f"(exit {r.exit_code}): {r.stderr.strip()[-1000:]}"
        )
    try:
        return Probe(**json.loads(r.stdout.strip().splitlines()[-1]))
    except (ValueError, IndexError, TypeError) as e:
        raise PatchError(
            f"[{host.name}] unexpected probe output from {python}: {r.stdout[-500:]!r}"
        ) from e


def sglang_version(host: Host, python: str, env: dict[str, str] | None = None) -> str | None:
    """The sglang version importable by `python` on the host, or None."""
    return probe(host, python, env).version


def _probe_paths(patches_dir: Path) -> list[str]:
    paths = {DUMP_MODULE}
    for version in available_versions(patches_dir):
        manifest = json.loads((Path(patches_dir) / version / "manifest.json").read_text())
        paths.update(f["path"] for f in manifest["files"])
        paths.add(manifest["hook"]["module"])
    return sorted(paths)


def target_config_path(cfg: PipelineConfig) -> str:
    """The target's config.json on the server host."""
    return f"{str(cfg.target.checkpoint).rstrip('/')}/config.json"


def find_install(host: Host, cfg: PipelineConfig, patches_dir: Path) -> Probe:
    python = server_python(cfg.server)
    found = probe(host, python, cfg.server.env, _probe_paths(patches_dir), target_config_path(cfg))
    if found.version is None or found.site_dir is None:
        raise PatchError(
            f"[{host.name}] sglang is not installed for {python} (importlib finds "
            f"{'no package' if found.site_dir is None else 'no metadata'})"
        )
    return found
