"""The patch stage against the real sglang 0.5.23 wheel, on this machine and over a real sshd.

The wheel is fetched once with `pip download` into ~/.cache/eyas-test/wheels (tests that need it
skip, saying why, when that fails); each test unpacks the files it needs into a fake
site-packages (`<tmp>/site-packages/sglang/...` plus the wheel's dist-info, its version
rewritable), which the server python sees through PYTHONPATH in `server.env`, so
`importlib.metadata.version("sglang")` answers without importing SGLang's GPU dependencies.
"""

from __future__ import annotations

import difflib
import hashlib
import json
import py_compile
import re
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from eyas import sglang_patch
from eyas.hosts import LocalHost, SSHHost
from eyas.sglang_patch import PatchError, apply_diff, ensure_patched, reverse_patch
from tests.stage_config import stage_config

VERSION = "0.5.23"
WHEEL_CACHE = Path.home() / ".cache" / "eyas-test" / "wheels"
DSV2 = "sglang/srt/models/deepseek_v2.py"
SET_DIR = sglang_patch.PATCHES_DIR / VERSION
HOOK = "eyas_sglang_hook.py"


@pytest.fixture(scope="session")
def sglang_wheel() -> Path:
    """The sglang 0.5.23 wheel, downloaded once per machine with pip (skips if that fails)."""
    found = sorted(WHEEL_CACHE.glob(f"sglang-{VERSION}-*.whl"))
    if not found:
        WHEEL_CACHE.mkdir(parents=True, exist_ok=True)
        cmd = [sys.executable, "-m", "pip", "download", f"sglang=={VERSION}", "--no-deps",
               "-d", str(WHEEL_CACHE)]
        try:
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=900, check=False)
            why = f"exit {r.returncode}: {(r.stderr or r.stdout).strip()[-300:]}"
        except (OSError, subprocess.TimeoutExpired) as e:
            why = f"{type(e).__name__}: {e}"
        found = sorted(WHEEL_CACHE.glob(f"sglang-{VERSION}-*.whl"))
        if not found:
            pytest.skip(f"`pip download sglang=={VERSION} --no-deps` failed ({why}); put the wheel "
                        f"in {WHEEL_CACHE} to run this test")
    return found[0]


def wheel_text(wheel: Path, member: str) -> str:
    with zipfile.ZipFile(wheel) as z:
        return z.read(member).decode()


def make_site(root: Path, wheel: Path, version: str = VERSION) -> Path:
    """A site-packages holding sglang's deepseek_v2.py and dist-info (METADATA says `version`)."""
    site = root / "site-packages"
    with zipfile.ZipFile(wheel) as z:
        (site / DSV2).parent.mkdir(parents=True, exist_ok=True)
        (site / DSV2).write_bytes(z.read(DSV2))
        metadata = z.read(f"sglang-{VERSION}.dist-info/METADATA").decode()
    info = site / f"sglang-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(re.sub(r"(?m)^Version: .*$", f"Version: {version}", metadata))
    return site


def sglang_config(tmp: Path, site: Path, host: dict | None = None):
    overrides = {"server.backend": "sglang", "server.python": sys.executable,
                 "server.env": {"PYTHONPATH": str(site)}}
    if host is not None:
        overrides["server.host"] = host
    return stage_config(tmp, tmp / "checkpoint", **overrides)


def sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture
def site(tmp_path, sglang_wheel) -> Path:
    return make_site(tmp_path, sglang_wheel)


# ---------------------------------------------------------------------------------------------
# The patch set itself
# ---------------------------------------------------------------------------------------------

def test_manifest_matches_the_wheel_the_patch_and_the_hook(sglang_wheel):
    manifest = json.loads((SET_DIR / "manifest.json").read_text())
    assert manifest["sglang_version"] == VERSION and manifest["patch_version"].startswith("eyas-sglang-")
    [entry] = manifest["files"]
    original = wheel_text(sglang_wheel, entry["path"])
    assert hashlib.sha256(original.encode()).hexdigest() == entry["original_sha256"]
    patched = apply_diff(original, (SET_DIR / entry["patch"]).read_text())
    assert hashlib.sha256(patched.encode()).hexdigest() == entry["patched_sha256"]
    compile(patched, entry["path"], "exec")
    assert sha(SET_DIR / manifest["hook"]["module"]) == manifest["hook"]["sha256"]
    # the hook names the same patch version the manifest gives the extraction cache key
    assert f'PATCH_VERSION = "{manifest["patch_version"]}"' in (SET_DIR / HOOK).read_text()
    # the patch is a plain unified diff: `patch -p1` applies it in site-packages
    assert (SET_DIR / entry["patch"]).read_text().startswith(f"--- a/{entry['path']}\n+++ b/{entry['path']}\n")


def test_apply_diff_is_strict_and_reversible():
    old = "a\nb\nc\nd\n"
    new = "a\nb\nB2\nc\nd"  # also drops the final newline
    diff = "".join(difflib.unified_diff(old.splitlines(True), new.splitlines(True), "a/f.py", "b/f.py"))
    diff = diff.replace("+d", "+d\n\\ No newline at end of file")
    assert apply_diff(old, diff) == new
    assert apply_diff(new, diff, reverse=True) == old
    with pytest.raises(PatchError, match="does not match"):
        apply_diff(new, diff)  # already applied: the context no longer matches
    with pytest.raises(PatchError, match="does not match"):
        apply_diff(old.replace("b", "x"), diff)


# ---------------------------------------------------------------------------------------------
# On this machine
# ---------------------------------------------------------------------------------------------

def test_apply_is_idempotent_and_reverse_restores_the_original_bytes(tmp_path, site):
    host, cfg = LocalHost(), sglang_config(tmp_path, site)
    original = (site / DSV2).read_bytes()
    manifest = json.loads((SET_DIR / "manifest.json").read_text())

    planned = ensure_patched(host, cfg, dry_run=True)
    assert planned["status"] == "would patch" and (site / DSV2).read_bytes() == original
    assert not (site / HOOK).exists()

    done = ensure_patched(host, cfg)
    assert done["status"] == "patched" and done["sglang_version"] == VERSION
    assert done["patch_version"] == manifest["patch_version"]
    assert done["actions"] == {DSV2: "patched", HOOK: "installed", "eyas_dump.py": "installed"}
    assert sha(site / DSV2) == manifest["files"][0]["patched_sha256"]
    assert (site / HOOK).read_bytes() == (SET_DIR / HOOK).read_bytes()
    assert (site / "eyas_dump.py").read_bytes() == sglang_patch.DUMP_SOURCE.read_bytes()
    state = json.loads((site / "sglang" / ".eyas-patch.json").read_text())
    assert state["patch_version"] == manifest["patch_version"] and state["sglang_version"] == VERSION
    assert state["files"][0]["original_sha256"] == hashlib.sha256(original).hexdigest()
    py_compile.compile(str(site / DSV2), cfile=str(tmp_path / "dsv2.pyc"), doraise=True)
    assert not list(site.rglob("*.tmp-*"))  # writes went through temp files that were renamed

    stamp = (site / DSV2).stat().st_mtime_ns
    again = ensure_patched(host, cfg)
    assert again["status"] == "already patched" and again["patch_version"] == done["patch_version"]
    assert set(again["actions"].values()) == {"already patched", "up to date"}
    assert (site / DSV2).stat().st_mtime_ns == stamp

    undone = reverse_patch(host, cfg)
    assert undone["status"] == "reversed" and undone["actions"][DSV2] == "restored"
    assert (site / DSV2).read_bytes() == original
    assert not (site / HOOK).exists() and not (site / "eyas_dump.py").exists()
    assert not (site / "sglang" / ".eyas-patch.json").exists()
    assert reverse_patch(host, cfg)["status"] == "not patched"


def test_another_sglang_version_is_refused_naming_it(tmp_path, sglang_wheel):
    site = make_site(tmp_path, sglang_wheel, version="0.5.22")
    with pytest.raises(PatchError) as e:
        ensure_patched(LocalHost(), sglang_config(tmp_path, site))
    assert "sglang 0.5.22 has no eyas patch set" in str(e.value) and VERSION in str(e.value)
    assert sglang_patch.sglang_version(LocalHost(), sys.executable, {"PYTHONPATH": str(site)}) == "0.5.22"


def test_a_locally_modified_file_is_refused_and_nothing_is_written(tmp_path, site):
    with open(site / DSV2, "a") as f:
        f.write("# a local fix\n")
    with pytest.raises(PatchError) as e:
        ensure_patched(LocalHost(), sglang_config(tmp_path, site))
    msg = str(e.value)
    assert str(site / DSV2) in msg and "modified locally" in msg
    assert sha(site / DSV2) in msg and json.loads((SET_DIR / "manifest.json").read_text())[
        "files"][0]["original_sha256"] in msg
    assert not (site / HOOK).exists() and not (site / "sglang" / ".eyas-patch.json").exists()


def test_missing_sglang_and_the_local_backend(tmp_path, site):
    cfg = sglang_config(tmp_path, tmp_path / "empty")
    with pytest.raises(PatchError, match="sglang is not installed for"):
        ensure_patched(LocalHost(), cfg)
    local = stage_config(tmp_path, tmp_path / "checkpoint")
    assert ensure_patched(LocalHost(), local)["status"] == "not needed"
    assert reverse_patch(LocalHost(), local)["status"] == "not needed"


def test_a_changed_module_or_a_reinstalled_sglang_is_redone(tmp_path, site, sglang_wheel):
    host, cfg = LocalHost(), sglang_config(tmp_path, site)
    ensure_patched(host, cfg)
    (site / "eyas_dump.py").write_text("# stale\n")
    redo = ensure_patched(host, cfg)
    assert redo["status"] == "patched" and redo["actions"]["eyas_dump.py"] == "updated"
    assert redo["actions"][DSV2] == "already patched"
    assert (site / "eyas_dump.py").read_bytes() == sglang_patch.DUMP_SOURCE.read_bytes()
    # pip install --force-reinstall puts the original back but leaves the state file behind
    (site / DSV2).write_text(wheel_text(sglang_wheel, DSV2))
    assert ensure_patched(host, cfg, dry_run=True)["status"] == "would patch"
    assert ensure_patched(host, cfg)["actions"][DSV2] == "patched"


def test_an_older_eyas_patch_is_replaced(tmp_path, site):
    """A host patched by an earlier patch revision: reversed with the recorded diff, then patched."""
    host, cfg = LocalHost(), sglang_config(tmp_path, site)
    original = (site / DSV2).read_text()
    older = original.replace('"""Inference-only DeepseekV2 model."""',
                             '"""Inference-only DeepseekV2 model."""\n# eyas r0 was here')
    diff = "".join(difflib.unified_diff(original.splitlines(True), older.splitlines(True),
                                        f"a/{DSV2}", f"b/{DSV2}"))
    (site / DSV2).write_text(older)
    (site / "sglang" / ".eyas-patch.json").write_text(json.dumps({
        "format": 1, "patch_version": "eyas-sglang-0.5.23-r0", "sglang_version": VERSION,
        "files": [{"path": DSV2, "diff": diff, "original_sha256": hashlib.sha256(original.encode()).hexdigest(),
                   "patched_sha256": hashlib.sha256(older.encode()).hexdigest()}], "modules": {}}))
    done = ensure_patched(host, cfg)
    assert done["actions"][DSV2] == "re-patched (was eyas-sglang-0.5.23-r0)"
    assert sha(site / DSV2) == json.loads((SET_DIR / "manifest.json").read_text())["files"][0]["patched_sha256"]
    reverse_patch(host, cfg)
    assert (site / DSV2).read_text() == original


# ---------------------------------------------------------------------------------------------
# Over SSH, against a real sshd on loopback
# ---------------------------------------------------------------------------------------------

@pytest.mark.ssh
def test_the_same_over_ssh(tmp_path, sglang_wheel, sshd):
    host_cfg = dict(kind="ssh", name="loopback", hostname="127.0.0.1", port=sshd.port, user=sshd.user,
                    key_filename=str(sshd.client_key), known_hosts=str(sshd.known_hosts),
                    connect_timeout_s=5)
    site = make_site(tmp_path, sglang_wheel)
    cfg = sglang_config(tmp_path, site, host_cfg)
    original = (site / DSV2).read_bytes()
    host = SSHHost(cfg.server.host)
    try:
        assert ensure_patched(host, cfg)["status"] == "patched"
        assert (site / HOOK).read_bytes() == (SET_DIR / HOOK).read_bytes()
        py_compile.compile(str(site / DSV2), cfile=str(tmp_path / "dsv2.pyc"), doraise=True)
        assert ensure_patched(host, cfg)["status"] == "already patched"
        assert reverse_patch(host, cfg)["status"] == "reversed"
        assert (site / DSV2).read_bytes() == original and not (site / HOOK).exists()

        (site / DSV2).write_bytes(original + b"# drift\n")
        with pytest.raises(PatchError, match=re.escape(f"[loopback] {site / DSV2} has sha256")):
            ensure_patched(host, cfg)

        other = make_site(tmp_path / "old", sglang_wheel, version="0.5.22")
        with pytest.raises(PatchError, match="sglang 0.5.22 has no eyas patch set"):
            ensure_patched(host, sglang_config(tmp_path, other, host_cfg))
    finally:
        host.close()
