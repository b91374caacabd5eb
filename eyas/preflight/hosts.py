"""Hosts reached through the Host seam: a command run with every failure turned into a problem
naming the host's fields, and the SSH server host's access and SGLang version."""

from __future__ import annotations

import shlex
from pathlib import Path

from eyas.config import HostConfig, PipelineConfig

SGLANG_VERSION_CODE = 'import importlib.metadata as m; print(m.version("sglang"))'


def run_on(
    hcfg: HostConfig, where: str, command: str, problems: list[str], env: dict | None = None
):
    """The RunResult of command on the host, or None with a problem naming the host's fields."""
    from eyas.server.hosts import HostAuthError, HostError, HostUnreachable, make_host

    try:
        host = make_host(hcfg)
    except (OSError, HostError) as e:  # e.g. the known_hosts file is missing or unreadable
        problems.append(f"{where}.known_hosts={hcfg.known_hosts}: cannot be read ({e})")
        return None
    try:
        with host:
            return host.run(command, check=False, timeout=120, env=env)
    except HostAuthError as e:
        problems.append(
            f"{where}.hostname={hcfg.hostname}: "
            f"{hcfg.user or ''}@{hcfg.hostname}:{hcfg.port} refused "
            f"{where}.key_filename={hcfg.key_filename}, or its host key is not in "
            f"{where}.known_hosts={hcfg.known_hosts} ({e})"
        )
    except HostUnreachable as e:
        problems.append(
            f"{where}.hostname={hcfg.hostname}: unreachable on {where}.port={hcfg.port} ({e})"
        )
    except HostError as e:
        problems.append(f"{where}.hostname={hcfg.hostname}: {e}")
    return None


def check_host_access(
    cfg: PipelineConfig, problems: list[str], notes: list[str], check: bool, patches_dir: Path
) -> str | None:
    """The sglang version on an SSH server host (None when not asked or not found)."""
    s = cfg.server
    if s.host.kind != "ssh":
        notes.append(
            "server.host.kind=local: no SSH or SGLang version check (the server runs on "
            "this machine)"
        )
        return None
    if not check:
        notes.append(
            "host checks skipped (check_hosts=False): SSH reachability, host keys and the SGLang "
            "version were not checked"
        )
        return None
    from eyas.server.patch_sets import available_versions
    from eyas.server.sglang_probe import server_python

    python = server_python(s)
    code = SGLANG_VERSION_CODE if s.backend == "sglang" else "import eyas"
    r = run_on(
        s.host, "server.host", f"{shlex.quote(python)} -c {shlex.quote(code)}", problems, env=s.env
    )
    version = None
    if r is not None and not r.ok:
        what = "report sglang's version" if s.backend == "sglang" else "import eyas"
        problems.append(
            f"server.python={python}: cannot {what} on {s.host.hostname} (exit {r.exit_code}): "
            f"{r.stderr.strip()[-300:]}"
        )
    elif r is not None and s.backend == "sglang":
        version = (r.stdout.strip().splitlines() or [""])[-1]
        if version not in available_versions(patches_dir):
            problems.append(
                f"server.python={python}: sglang {version} on {s.host.hostname} has no "
                f"eyas patch set (patches/sglang/ has {available_versions(patches_dir)})"
            )
            version = None
    for i, h in enumerate(cfg.training.distributed.hosts):
        if h.kind == "ssh":
            run_on(h, f"training.distributed.hosts.{i}", "true", problems)
    return version
