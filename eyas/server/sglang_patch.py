"""The patch stage: make an SGLang host able to dump hidden states, idempotently and reversibly.

    result = ensure_patched(host, cfg)            # {"status": "patched" | "already patched", ...}
    ensure_patched(host, cfg, dry_run=True)       # what it would do; refuses the same way
    reverse_patch(host, cfg)                      # original bytes back, hook modules removed
    python -m eyas.server.sglang_patch status|apply|reverse configs/kimi-k2.5-sglang.yaml

Everything goes through the Host seam (the server's python runs one probe script; files move with
get/put, which write a temp file and rename it), so a GPU host over SSH is patched exactly like
this machine. What is installed comes from `patches/sglang/<version>/` (manifest.json, the
forward-hook module, the source patch) plus eyas/dump.py, copied as `eyas_dump.py`:

    <site-packages>/eyas_sglang_hook.py           the --forward-hooks hook (SGLang's factory path)
    <site-packages>/eyas_dump.py                  eyas/dump.py, byte for byte (the one writer)
    <site-packages>/sglang/srt/models/deepseek_v2.py   server.capture source_patch only: dumps
                                                       without --forward-hooks (EYAS_DUMP_DIR)
    <site-packages>/sglang/.eyas-patch.json       what was applied: capture mode, version,
                                                  sha256s, diffs

server.capture forward_hook (the default) changes no SGLang file: a model file eyas patched before
is restored, and one patched by hand or installed from source is accepted while it compiles and
keeps SGLang's capture code (`CAPTURE_MARKERS`). With source_patch a target file is patched only
when its sha256 is the manifest's original; the patched sha256 means done; anything else is
refused with both hashes. A target whose config.json names an architecture the manifest does not
list for the mode (`check_architecture`) is refused too. The local backend needs nothing.
"""

from __future__ import annotations

import json
import shlex
import sys
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path

from eyas.config import PipelineConfig
from eyas.files import sha256_bytes
from eyas.server.hook_import import check_modules_import
from eyas.server.hosts import Host
from eyas.server.patch_sets import (
    DUMP_MODULE,
    PATCHES_DIR,
    PatchedFile,
    PatchError,
    PatchSet,
    apply_diff,
    available_versions,
    check_architecture,
    load_patch_set,
)
from eyas.server.sglang_probe import STATE_NAME, Probe, find_install

STATE_FORMAT = 1


@dataclass(frozen=True)
class PatchReport:
    """What the patch stage found on a host and did there (or would do): report.json's `patch`."""

    backend: str
    host: str
    status: str  # patched | already patched | would patch | reversed | not patched | not needed
    reason: str | None = None  # why nothing was needed
    python: str | None = None  # the server's interpreter
    sglang_version: str | None = None
    patch_version: str | None = None  # the patch set applied; shard cache keys carry it
    capture: str | None = None  # server.capture
    site_packages: str | None = None
    state_path: str | None = None
    actions: dict[str, str] = field(
        default_factory=dict
    )  # file or hook module -> what was done to it
    dump_sha256: str | None = None  # of the dump writer installed beside SGLang
    architecture: str | None = None  # the target's, as checked against the patch set

    def to_json(self) -> dict:
        return {k: v for k, v in asdict(self).items() if v is not None}


LOCAL_NEEDS_NONE = "eyas serve-local writes hidden-state dumps itself"

# ---------------------------------------------------------------------------------------------
# Remote files
# ---------------------------------------------------------------------------------------------


def _remote(found: Probe, rel: str) -> str:
    return f"{found.site_dir}/{rel}"


def _read(host: Host, remote: str) -> bytes:
    with tempfile.TemporaryDirectory(prefix="eyas-patch-") as tmp:
        local = Path(tmp) / "file"
        host.get(remote, local)
        return local.read_bytes()


def _write(host: Host, remote: str, data: bytes) -> None:
    """Write bytes to the host atomically (put writes a temp file beside it, then renames)."""
    with tempfile.TemporaryDirectory(prefix="eyas-patch-") as tmp:
        local = Path(tmp) / "file"
        local.write_bytes(data)
        host.put(local, remote)


def _refuse_modified(
    host: Host, found: Probe, rel: str, current: str | None, original: str, patched: str
) -> PatchError:
    where = _remote(found, rel)
    if current is None:
        return PatchError(f"[{host.name}] {where} is missing; reinstall sglang=={found.version}")
    return PatchError(
        f"[{host.name}] {where} has sha256 {current}, which is neither sglang "
        f"{found.version}'s original {original} nor eyas's patched {patched}: it was "
        f"modified locally; reinstall sglang=={found.version} (pip install "
        f"--force-reinstall --no-deps sglang=={found.version}) and patch again"
    )


def _usable_state(found: Probe) -> dict | None:
    """The recorded state, if it describes this install (pip leaves it behind on upgrade)."""
    state = found.state
    if not state or "unreadable" in state or state.get("sglang_version") != found.version:
        return None
    return state


# ---------------------------------------------------------------------------------------------
# Apply and reverse
# ---------------------------------------------------------------------------------------------


def ensure_patched(
    host: Host, cfg: PipelineConfig, *, dry_run: bool = False, patches_dir: Path = PATCHES_DIR
) -> PatchReport:
    """Bring the host to the patched state; returns what was found and done (or would be)."""
    if cfg.server.backend == "local":
        return PatchReport("local", host.name, "not needed", reason=LOCAL_NEEDS_NONE)
    mode = cfg.server.capture
    found, pset, architecture = _checked_install(host, cfg, patches_dir)
    # 1. Plan every file before writing anything, so a refusal leaves the host untouched.
    writes, actions = _plan(host, found, pset, mode, dry_run)
    # 2. Write: the modules first (the patched model file imports the hook), the state last.
    new_state = _state(pset, mode)
    steady = ("already patched", "up to date", ORIGINAL, LEFT)
    changed = found.state != new_state or any(
        a not in steady and not a.startswith("missing:") for a in actions.values()
    )
    if not dry_run:
        for name in sorted(writes, key=lambda n: n not in pset.modules):
            _write(host, _remote(found, name), writes[name])
        if found.state != new_state:
            _write(
                host, f"{found.package_dir}/{STATE_NAME}", json.dumps(new_state, indent=1).encode()
            )
    status = "already patched" if not changed else ("would patch" if dry_run else "patched")
    return PatchReport(
        "sglang",
        host.name,
        status,
        python=found.python,
        sglang_version=found.version,
        patch_version=pset.patch_version,
        capture=mode,
        site_packages=found.site_dir,
        state_path=f"{found.package_dir}/{STATE_NAME}",
        actions=actions,
        dump_sha256=sha256_bytes(pset.modules[DUMP_MODULE]),
        architecture=architecture,
    )


def _checked_install(
    host: Host, cfg: PipelineConfig, patches_dir: Path
) -> tuple[Probe, PatchSet, str | None]:
    """The install found on the host, its patch set and the target's architecture, once everything
    the patch needs is there: a known version and target, the hook's imports, a writable site."""
    found = find_install(host, cfg, patches_dir)
    try:
        pset = load_patch_set(found.version, patches_dir)
    except PatchError as e:
        raise PatchError(
            f"[{host.name}] {e} (python {found.python}, {found.package_dir})"
        ) from None
    architecture = _check_target(host, found, pset, cfg.server.capture)
    if found.missing_modules:
        raise PatchError(
            f"[{host.name}] {found.python} cannot import {found.missing_modules}, "
            f"which the hook needs"
        )
    if not found.writable:
        raise PatchError(f"[{host.name}] {found.site_dir} is not writable by this user")
    check_modules_import(host, found.python, cfg.server.env, pset.modules)
    return found, pset, architecture


# One branch per state a file can be found in (patched, original, an older patch set's, changed by
# hand) and per capture mode: the decision table reads best flat.
def _plan(  # noqa: C901
    host: Host, found: Probe, pset: PatchSet, mode: str, dry_run: bool
) -> tuple[dict[str, bytes], dict]:
    """(the bytes to write per file, what happens to each file), refusing a file changed by hand."""
    state = _usable_state(found)
    stale = {
        f["path"]: f
        for f in (state or {}).get("files", [])
        if state["patch_version"] != pset.patch_version
    }
    writes: dict[str, bytes] = {}
    actions: dict[str, str] = {}
    for f in pset.files:
        current = found.sha256.get(f.path)
        old = stale.pop(f.path, None)
        if mode == "forward_hook":
            action, restored = _hook_only(host, found, f, old, dry_run)
            actions[f.path] = action
            if restored is not None:
                writes[f.path] = restored
        elif current == f.patched_sha256:
            actions[f.path] = "already patched"
        elif current == f.original_sha256 or (old and current == old["patched_sha256"]):
            actions[f.path] = (
                "patched"
                if current == f.original_sha256
                else f"re-patched (was {state['patch_version']})"
            )
            if not dry_run:
                writes[f.path] = _patched_bytes(host, found, f, old)
        else:
            raise _refuse_modified(
                host, found, f.path, current, f.original_sha256, f.patched_sha256
            )
    for rel, old in stale.items():  # a file the older patch set touched and this one does not
        if found.sha256.get(rel) == old["patched_sha256"]:
            actions[rel] = f"restored (was {state['patch_version']})"
            if not dry_run:
                writes[rel] = _reversed_bytes(host, found, rel, old["diff"], old["original_sha256"])
    for name, data in pset.modules.items():
        current = found.sha256.get(name)
        if current != sha256_bytes(data):
            actions[name] = "installed" if current is None else "updated"
            writes[name] = data
        else:
            actions[name] = "up to date"
    return writes, actions


def _state(pset: PatchSet, mode: str) -> dict:
    """The state file's contents once patched: which files changed how, and the modules' digests."""
    patched = pset.files if mode == "source_patch" else []
    return {
        "format": STATE_FORMAT,
        "patch_version": pset.patch_version,
        "sglang_version": pset.sglang_version,
        "capture": mode,
        "files": [
            {
                "path": f.path,
                "original_sha256": f.original_sha256,
                "patched_sha256": f.patched_sha256,
                "diff": f.diff,
            }
            for f in patched
        ],
        "modules": {name: sha256_bytes(data) for name, data in pset.modules.items()},
    }


ORIGINAL = "original: the forward hook needs no change"
LEFT = (
    "left as is: not sglang's original bytes, but its capture code is there; the forward hook "
    "needs no change"
)
# What a model file must still define for SGLang's own capture (set_eagle3_layers_to_capture and the
# aux states it hands to the logits processor), which the forward hook reads.
CAPTURE_MARKERS = ("def set_eagle3_layers_to_capture", "capture_aux_hidden_states")


def _hook_only(
    host: Host, found: Probe, f: PatchedFile, old: dict | None, dry_run: bool
) -> tuple[str, bytes | None]:
    """server.capture forward_hook: a file eyas patched goes back to the original; an SGLang patched
    by hand or installed from source is accepted while its capture code compiles and is there."""
    current = found.sha256.get(f.path)
    if current == f.original_sha256:
        return ORIGINAL, None
    if current == f.patched_sha256 or (old and current == old["patched_sha256"]):
        diff = f.diff if current == f.patched_sha256 else old["diff"]
        action = "restored: capture by the forward hook"
        return action, None if dry_run else _reversed_bytes(
            host, found, f.path, diff, f.original_sha256
        )
    where = _remote(found, f.path)
    if current is None:
        return f"missing: {where} (targets of that model file cannot be served)", None
    text = _read(host, where).decode(errors="replace")
    try:
        compile(text, where, "exec")
    except SyntaxError as e:
        raise PatchError(
            f"[{host.name}] {where} (sha256 {current}, modified locally) does not compile: "
            f"{e}; reinstall sglang=={found.version}"
        ) from None
    missing = [m for m in CAPTURE_MARKERS if m not in text]
    if missing:
        raise PatchError(
            f"[{host.name}] {where} (sha256 {current}, modified locally) no longer has "
            f"{missing}, SGLang's aux hidden-state capture that the forward hook reads; "
            f"reinstall sglang=={found.version}"
        )
    return LEFT, None


def _check_target(host: Host, found: Probe, pset: PatchSet, capture: str) -> str:
    """The target's architecture, checked against the patch set (refused if unsupported).

    A config.json the probe could not find is reported, not refused: the server cannot start
    without one and says so itself.
    """
    tc = found.target_config or {}
    where = f"[{host.name}] {tc.get('path', 'the target config.json')}"
    if "error" in tc:
        raise PatchError(f"{where} cannot be read: {tc['error']}")
    if "architectures" not in tc:
        return f"unchecked: no config.json at {tc.get('path')}"
    return check_architecture(pset, tc["architectures"], where, capture=capture)


def _patched_bytes(host: Host, found: Probe, f: PatchedFile, old: dict | None) -> bytes:
    """The patched content of f, from the host's copy (reversing an older eyas patch first)."""
    where = _remote(found, f.path)
    data = _read(host, where)
    if old and sha256_bytes(data) == old["patched_sha256"]:
        data = apply_diff(data.decode(), old["diff"], reverse=True, name=where).encode()
    if sha256_bytes(data) != f.original_sha256:
        raise _refuse_modified(
            host, found, f.path, sha256_bytes(data), f.original_sha256, f.patched_sha256
        )
    patched = apply_diff(data.decode(), f.diff, name=where).encode()
    if sha256_bytes(patched) != f.patched_sha256:
        raise PatchError(
            f"{where}: the patch applied, but the result has sha256 {sha256_bytes(patched)}, "
            f"not the manifest's {f.patched_sha256}: the patch set is inconsistent"
        )
    return patched


def _reversed_bytes(host: Host, found: Probe, rel: str, diff: str, original_sha256: str) -> bytes:
    where = _remote(found, rel)
    restored = apply_diff(_read(host, where).decode(), diff, reverse=True, name=where).encode()
    if sha256_bytes(restored) != original_sha256:
        raise PatchError(
            f"[{host.name}] {where}: reversing the recorded patch gives sha256 "
            f"{sha256_bytes(restored)}, not the original {original_sha256}"
        )
    return restored


def _patched_records(found: Probe, patches_dir: Path) -> tuple[list[dict], list[str]]:
    """(the files eyas patched, with their diffs and digests; the modules it installed): from the
    state file, else from the version's manifest where the state was lost, else the hook's
    modules."""
    state = _usable_state(found)
    if state is not None:
        return state["files"], list(state.get("modules", {}))
    if found.version in available_versions(patches_dir):
        pset = load_patch_set(found.version, patches_dir)
        return (
            [
                {
                    "path": f.path,
                    "diff": f.diff,
                    "original_sha256": f.original_sha256,
                    "patched_sha256": f.patched_sha256,
                }
                for f in pset.files
            ],
            list(pset.modules),
        )
    return [], [DUMP_MODULE, "eyas_sglang_hook.py"]


def reverse_patch(
    host: Host, cfg: PipelineConfig, *, patches_dir: Path = PATCHES_DIR
) -> PatchReport:
    """Restore the original bytes of every patched file and remove the hook modules and state."""
    if cfg.server.backend == "local":
        return PatchReport("local", host.name, "not needed", reason=LOCAL_NEEDS_NONE)
    found = find_install(host, cfg, patches_dir)
    claimed = (
        _usable_state(found) is not None
    )  # the state names what eyas patched: anything else is refused
    records, modules = _patched_records(found, patches_dir)
    writes, actions = {}, {}
    for rec in records:
        current = found.sha256.get(rec["path"])
        if current == rec["original_sha256"]:
            actions[rec["path"]] = "original"
        elif current == rec["patched_sha256"]:
            writes[rec["path"]] = _reversed_bytes(
                host, found, rec["path"], rec["diff"], rec["original_sha256"]
            )
            actions[rec["path"]] = "restored"
        elif (
            not claimed and current is not None
        ):  # patched by hand or built from source: not eyas's
            actions[rec["path"]] = "left as is: not eyas's patch"
        else:
            raise _refuse_modified(
                host, found, rec["path"], current, rec["original_sha256"], rec["patched_sha256"]
            )
    for rel, data in writes.items():
        _write(host, _remote(found, rel), data)
    present = [m for m in modules if found.sha256.get(m) is not None]
    for m in present:
        actions[m] = "removed"
    doomed = [_remote(found, m) for m in present]
    if found.state is not None:
        doomed.append(f"{found.package_dir}/{STATE_NAME}")
    if doomed:
        host.run("rm -f " + " ".join(shlex.quote(p) for p in doomed))
    status = "reversed" if writes or doomed else "not patched"
    return PatchReport(
        "sglang",
        host.name,
        status,
        python=found.python,
        sglang_version=found.version,
        site_packages=found.site_dir,
        actions=actions,
    )


def main(argv: list[str] | None = None) -> int:
    """python -m eyas.server.sglang_patch status|apply|reverse CONFIG.yaml"""
    from eyas.config import load_config
    from eyas.server.hosts import make_host

    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 2 or argv[0] not in ("status", "apply", "reverse"):
        print(main.__doc__, file=sys.stderr)
        return 2
    cfg = load_config(argv[1])
    try:
        with make_host(cfg.server.host) as host:
            result = (
                reverse_patch(host, cfg)
                if argv[0] == "reverse"
                else ensure_patched(host, cfg, dry_run=argv[0] == "status")
            )
    except PatchError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(json.dumps(result.to_json(), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
