"""The patch stage against the real sglang 0.5.23 wheel, on this machine and over a real sshd.

The wheel is fetched once with `pip download` into ~/.cache/eyas-test/wheels (tests that need it
skip, saying why, when that fails); each test unpacks the files it needs into a fake
site-packages (`<tmp>/site-packages/sglang/...` plus the wheel's dist-info, its version
rewritable), which the server python sees through PYTHONPATH in `server.env`, so
`importlib.metadata.version("sglang")` answers without importing SGLang's GPU dependencies.
"""

from __future__ import annotations

import ast
import difflib
import hashlib
import json
import py_compile
import re
import sys
import zipfile
from pathlib import Path

import pytest

from eyas.server import patch_sets, sglang_patch, sglang_probe
from eyas.server.hosts import LocalHost
from eyas.server.patch_sets import PATCHES_DIR, PatchError, apply_diff
from eyas.server.sglang_patch import ensure_patched, reverse_patch
from eyas.server.ssh_host import SSHHost
from tests.sglang_wheel import DSV2, TARGET_ARCH, VERSION, make_site, sglang_config, wheel_text  # noqa: F401
from tests.stage_config import stage_config

SET_DIR = PATCHES_DIR / VERSION
HOOK = "eyas_sglang_hook.py"


def sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture
def site(tmp_path, sglang_wheel) -> Path:
    return make_site(tmp_path, sglang_wheel)


# ---------------------------------------------------------------------------------------------
# server.capture forward_hook (the default): no SGLang file changes
# ---------------------------------------------------------------------------------------------


def test_the_forward_hook_alone_changes_no_sglang_file_and_reverses(tmp_path, site):
    host, cfg = LocalHost(), sglang_config(tmp_path, site, capture="forward_hook")
    assert stage_config(tmp_path, tmp_path / "c").server.capture == "forward_hook"  # the default
    original = (site / DSV2).read_bytes()
    done = ensure_patched(host, cfg)
    assert done.status == "patched" and done.capture == "forward_hook"
    assert done.actions == {
        DSV2: sglang_patch.ORIGINAL,
        HOOK: "installed",
        "eyas_dump.py": "installed",
    }
    assert (site / DSV2).read_bytes() == original and (site / HOOK).is_file()
    state = json.loads((site / "sglang" / ".eyas-patch.json").read_text())
    assert state["capture"] == "forward_hook" and state["files"] == []
    assert ensure_patched(host, cfg).status == "already patched"
    undone = reverse_patch(host, cfg)
    assert undone.status == "reversed" and not (site / HOOK).exists()
    assert (site / DSV2).read_bytes() == original


def test_an_earlier_source_patch_is_restored_when_the_hook_alone_captures(tmp_path, site):
    host, original = LocalHost(), (site / DSV2).read_bytes()
    ensure_patched(host, sglang_config(tmp_path, site, capture="source_patch"))
    assert (site / DSV2).read_bytes() != original
    cfg = sglang_config(tmp_path, site, capture="forward_hook")
    planned = ensure_patched(host, cfg, dry_run=True)
    assert planned.actions[DSV2].startswith("restored") and (site / DSV2).read_bytes() != original
    done = ensure_patched(host, cfg)
    assert done.actions[DSV2].startswith("restored") and (site / DSV2).read_bytes() == original


def test_an_sglang_patched_by_hand_is_accepted_while_its_capture_code_is_there(tmp_path, site):
    """The seed's team patched deepseek_v2.py by hand: the hook alone works beside that; the source
    patch refuses it; a file that lost SGLang's capture code is refused naming what is missing."""
    text = (site / DSV2).read_text()
    (site / DSV2).write_text(text + "\n_TEAM_DUMP = '/dev/shm/hs'  # the team's own patch\n")
    hand = (site / DSV2).read_bytes()
    with pytest.raises(PatchError, match="modified locally"):
        ensure_patched(LocalHost(), sglang_config(tmp_path, site, capture="source_patch"))
    done = ensure_patched(LocalHost(), sglang_config(tmp_path, site, capture="forward_hook"))
    assert done.actions[DSV2] == sglang_patch.LEFT and (site / DSV2).read_bytes() == hand
    assert (
        reverse_patch(LocalHost(), sglang_config(tmp_path, site, capture="forward_hook")).status
        == "reversed"
    )
    assert (site / DSV2).read_bytes() == hand  # reverse leaves what eyas did not write

    (site / DSV2).write_text(text.replace("def set_eagle3_layers_to_capture", "def _layers_off"))
    with pytest.raises(PatchError, match="set_eagle3_layers_to_capture") as e:
        ensure_patched(LocalHost(), sglang_config(tmp_path, site, capture="forward_hook"))
    assert str(site / DSV2) in str(e.value) and not (site / HOOK).exists()


def test_a_llama_target_is_captured_by_the_forward_hook_alone(tmp_path, site):
    cfg = sglang_config(tmp_path, site, architectures=["LlamaForCausalLM"], capture="forward_hook")
    assert ensure_patched(LocalHost(), cfg).architecture == "LlamaForCausalLM"


# ---------------------------------------------------------------------------------------------
# The patch set itself
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("version", patch_sets.available_versions())
def test_manifest_matches_the_wheel_the_patch_and_the_hook(version):
    from tests.sglang_wheel import download_wheel

    wheel, folder = download_wheel(version), PATCHES_DIR / version
    manifest = json.loads((folder / "manifest.json").read_text())
    assert manifest["sglang_version"] == version
    assert manifest["patch_version"].startswith(f"eyas-sglang-{version}-r")
    [entry] = manifest["files"]
    original = wheel_text(wheel, entry["path"])
    assert hashlib.sha256(original.encode()).hexdigest() == entry["original_sha256"]
    patch = (folder / entry["patch"]).read_text()
    patched = apply_diff(original, patch)
    assert hashlib.sha256(patched.encode()).hexdigest() == entry["patched_sha256"]
    compile(patched, entry["path"], "exec")
    assert sha(PATCHES_DIR / manifest["hook"]["module"]) == manifest["hook"]["sha256"]
    # the patched file says which patch set wrote it
    assert f"patches/sglang/{version}/deepseek_v2.patch, {manifest['patch_version']}" in patched
    # the patch is a plain unified diff: `patch -p1` applies it in site-packages
    assert patch.startswith(f"--- a/{entry['path']}\n+++ b/{entry['path']}\n")


# ---------------------------------------------------------------------------------------------
# On this machine
# ---------------------------------------------------------------------------------------------


def test_apply_is_idempotent_and_reverse_restores_the_original_bytes(tmp_path, site):
    host, cfg = LocalHost(), sglang_config(tmp_path, site)
    original = (site / DSV2).read_bytes()
    manifest = json.loads((SET_DIR / "manifest.json").read_text())

    planned = ensure_patched(host, cfg, dry_run=True)
    assert planned.status == "would patch" and (site / DSV2).read_bytes() == original
    assert not (site / HOOK).exists()

    done = ensure_patched(host, cfg)
    assert done.status == "patched" and done.sglang_version == VERSION
    assert done.patch_version == manifest["patch_version"] and done.architecture == TARGET_ARCH
    assert done.actions == {DSV2: "patched", HOOK: "installed", "eyas_dump.py": "installed"}
    assert sha(site / DSV2) == manifest["files"][0]["patched_sha256"]
    assert (site / HOOK).read_bytes() == (PATCHES_DIR / HOOK).read_bytes()
    assert (site / "eyas_dump.py").read_bytes() == patch_sets.DUMP_SOURCE.read_bytes()
    state = json.loads((site / "sglang" / ".eyas-patch.json").read_text())
    assert (
        state["patch_version"] == manifest["patch_version"] and state["sglang_version"] == VERSION
    )
    assert state["files"][0]["original_sha256"] == hashlib.sha256(original).hexdigest()
    py_compile.compile(str(site / DSV2), cfile=str(tmp_path / "dsv2.pyc"), doraise=True)
    assert not list(site.rglob("*.tmp-*"))  # writes went through temp files that were renamed

    stamp = (site / DSV2).stat().st_mtime_ns
    again = ensure_patched(host, cfg)
    assert again.status == "already patched" and again.patch_version == done.patch_version
    assert set(again.actions.values()) == {"already patched", "up to date"}
    assert (site / DSV2).stat().st_mtime_ns == stamp

    undone = reverse_patch(host, cfg)
    assert undone.status == "reversed" and undone.actions[DSV2] == "restored"
    assert (site / DSV2).read_bytes() == original
    assert not (site / HOOK).exists() and not (site / "eyas_dump.py").exists()
    assert not (site / "sglang" / ".eyas-patch.json").exists()
    assert reverse_patch(host, cfg).status == "not patched"


def test_another_sglang_version_is_refused_naming_it(tmp_path, sglang_wheel):
    site = make_site(tmp_path, sglang_wheel, version="0.5.22")
    with pytest.raises(PatchError) as e:
        ensure_patched(LocalHost(), sglang_config(tmp_path, site))
    assert "sglang 0.5.22 has no eyas patch set" in str(e.value) and VERSION in str(e.value)
    assert (
        sglang_probe.sglang_version(LocalHost(), sys.executable, {"PYTHONPATH": str(site)})
        == "0.5.22"
    )


def test_a_locally_modified_file_is_refused_and_nothing_is_written(tmp_path, site):
    with open(site / DSV2, "a") as f:
        f.write("# a local fix\n")
    with pytest.raises(PatchError) as e:
        ensure_patched(LocalHost(), sglang_config(tmp_path, site))
    msg = str(e.value)
    assert str(site / DSV2) in msg and "modified locally" in msg
    assert (
        sha(site / DSV2) in msg
        and json.loads((SET_DIR / "manifest.json").read_text())["files"][0]["original_sha256"]
        in msg
    )
    assert not (site / HOOK).exists() and not (site / "sglang" / ".eyas-patch.json").exists()


def test_a_hook_that_does_not_import_in_the_server_python_is_refused_before_any_write(
    tmp_path, site, monkeypatch
):
    """The server's python has no eyas (as on a GPU host): a dump module that imports eyas, as one
    did, is refused at the patch stage, naming the missing module; nothing is written."""
    from tests.without_eyas import without_eyas

    cfg = sglang_config(tmp_path, site, capture="forward_hook")
    env = {"PYTHONPATH": f"{without_eyas(tmp_path)}:{site}"}
    cfg = cfg.model_copy(update={"server": cfg.server.model_copy(update={"env": env})})
    importing_eyas = tmp_path / "dump.py"
    source = patch_sets.DUMP_SOURCE.read_text()
    importing_eyas.write_text(
        source.replace("import torch\n", "import torch\n\nfrom eyas.errors import EyasError\n", 1)
    )
    monkeypatch.setattr(patch_sets, "DUMP_SOURCE", importing_eyas)
    with pytest.raises(PatchError) as e:
        ensure_patched(LocalHost(), cfg)
    assert "does not import in the server's python" in str(e.value) and "'eyas'" in str(e.value)
    assert not (site / HOOK).exists() and not (site / "eyas_dump.py").exists()
    assert not (site / "sglang" / ".eyas-patch.json").exists()
    monkeypatch.undo()  # the real dump module imports there
    assert ensure_patched(LocalHost(), cfg).status == "patched"


def test_missing_sglang_and_the_local_backend(tmp_path, site):
    cfg = sglang_config(tmp_path, tmp_path / "empty")
    with pytest.raises(PatchError, match="sglang is not installed for"):
        ensure_patched(LocalHost(), cfg)
    local = stage_config(tmp_path, tmp_path / "checkpoint")
    assert ensure_patched(LocalHost(), local).status == "not needed"
    assert reverse_patch(LocalHost(), local).status == "not needed"


def test_a_changed_module_or_a_reinstalled_sglang_is_redone(tmp_path, site, sglang_wheel):
    host, cfg = LocalHost(), sglang_config(tmp_path, site)
    ensure_patched(host, cfg)
    (site / "eyas_dump.py").write_text("# stale\n")
    redo = ensure_patched(host, cfg)
    assert redo.status == "patched" and redo.actions["eyas_dump.py"] == "updated"
    assert redo.actions[DSV2] == "already patched"
    assert (site / "eyas_dump.py").read_bytes() == patch_sets.DUMP_SOURCE.read_bytes()
    # pip install --force-reinstall puts the original back but leaves the state file behind
    (site / DSV2).write_text(wheel_text(sglang_wheel, DSV2))
    assert ensure_patched(host, cfg, dry_run=True).status == "would patch"
    assert ensure_patched(host, cfg).actions[DSV2] == "patched"


def test_an_older_eyas_patch_is_replaced(tmp_path, site):
    """A host patched by an earlier patch revision: reversed with the recorded diff, then
    patched."""
    host, cfg = LocalHost(), sglang_config(tmp_path, site)
    original = (site / DSV2).read_text()
    older = original.replace(
        '"""Inference-only DeepseekV2 model."""',
        '"""Inference-only DeepseekV2 model."""\n# eyas r0 was here',
    )
    diff = "".join(
        difflib.unified_diff(
            original.splitlines(True), older.splitlines(True), f"a/{DSV2}", f"b/{DSV2}"
        )
    )
    (site / DSV2).write_text(older)
    (site / "sglang" / ".eyas-patch.json").write_text(
        json.dumps(
            {
                "format": 1,
                "patch_version": "eyas-sglang-0.5.23-r0",
                "sglang_version": VERSION,
                "files": [
                    {
                        "path": DSV2,
                        "diff": diff,
                        "original_sha256": hashlib.sha256(original.encode()).hexdigest(),
                        "patched_sha256": hashlib.sha256(older.encode()).hexdigest(),
                    }
                ],
                "modules": {},
            }
        )
    )
    done = ensure_patched(host, cfg)
    assert done.actions[DSV2] == "re-patched (was eyas-sglang-0.5.23-r0)"
    assert (
        sha(site / DSV2)
        == json.loads((SET_DIR / "manifest.json").read_text())["files"][0]["patched_sha256"]
    )
    reverse_patch(host, cfg)
    assert (site / DSV2).read_text() == original


# ---------------------------------------------------------------------------------------------
# Architectures: which model classes the patch set supports
# ---------------------------------------------------------------------------------------------


def test_an_unsupported_architecture_is_refused_naming_it_the_file_and_the_list(tmp_path, site):
    manifest = json.loads((SET_DIR / "manifest.json").read_text())
    supported = manifest["architectures"]
    original = (site / DSV2).read_bytes()
    for arch, reason in (
        ("KimiVLForConditionalGeneration", "set_eagle3_layers_to_capture"),
        ("LlamaForCausalLM", "forward hook only"),
        ("GPT2LMHeadModel", None),
    ):
        cfg = sglang_config(tmp_path, site, architectures=[arch])
        for dry_run in (True, False):
            with pytest.raises(PatchError) as e:
                ensure_patched(LocalHost(), cfg, dry_run=dry_run)
            msg = str(e.value)
            assert f"architecture {arch} is not supported" in msg
            assert str(tmp_path / "checkpoint" / "config.json") in msg
            assert f"supported: {', '.join(supported)}" in msg and manifest["patch_version"] in msg
            assert (reason in msg) if reason else "set_eagle3" not in msg and "draft" not in msg
        assert (site / DSV2).read_bytes() == original and not (site / HOOK).exists()

    # the first name is what SGLang's registry builds; an empty list is refused too
    cfg = sglang_config(tmp_path, site, architectures=["DeepseekV3ForCausalLM", "LlamaForCausalLM"])
    assert ensure_patched(LocalHost(), cfg, dry_run=True).architecture == "DeepseekV3ForCausalLM"
    with pytest.raises(PatchError, match="names no architectures"):
        ensure_patched(LocalHost(), sglang_config(tmp_path, site, architectures=[]), dry_run=True)
    # no config.json on the host: reported, not refused (the server refuses to start without one)
    (tmp_path / "checkpoint" / "config.json").unlink()
    cfg = sglang_config(tmp_path, site, architectures=None)
    assert ensure_patched(LocalHost(), cfg, dry_run=True).architecture.startswith(
        "unchecked: no config.json"
    )


# Wrappers whose call into the language model tests/unit/test_sglang_hook.py drives from the wheel's
# code.
DRIVEN_WRAPPERS = {"KimiK25ForConditionalGeneration"}
NO_EAGLE3 = "defines no set_eagle3_layers_to_capture"


def _wheel_models(wheel: Path) -> tuple[dict[str, tuple[str, ast.ClassDef]], set[str]]:
    """Every class under sglang/srt/models (name -> (file, node)) and the EntryClass names."""
    classes, entries = {}, set()
    with zipfile.ZipFile(wheel) as z:
        for member in z.namelist():
            if not (member.startswith("sglang/srt/models/") and member.endswith(".py")):
                continue
            tree = ast.parse(z.read(member))
            for node in ast.walk(tree):
                if isinstance(node, ast.ClassDef):
                    classes.setdefault(node.name, (member, node))
            for node in tree.body:
                if isinstance(node, ast.Assign) and any(
                    getattr(t, "id", None) == "EntryClass" for t in node.targets
                ):
                    items = (
                        node.value.elts
                        if isinstance(node.value, (ast.List, ast.Tuple))
                        else [node.value]
                    )
                    entries.update(i.id for i in items if isinstance(i, ast.Name))
    return classes, entries


def _name(node) -> str | None:
    return (
        node.id
        if isinstance(node, ast.Name)
        else node.attr
        if isinstance(node, ast.Attribute)
        else None
    )


def _deepseek_family(classes) -> dict[str, str]:
    """Classes that subclass DeepseekV2ForCausalLM or build one (or a subclass) inside: name ->
    how."""
    family = {"DeepseekV2ForCausalLM": "itself"}
    grew = True
    while grew:
        grew = False
        for name, (_, node) in classes.items():
            if name in family:
                continue
            bases = [b for b in map(_name, node.bases) if b in family]
            built = sorted(
                {_name(c.func) for c in ast.walk(node) if isinstance(c, ast.Call)} & set(family)
            )
            if bases or built:
                family[name] = f"subclass of {bases[0]}" if bases else f"builds {built[0]}"
                grew = True
    return family


def _chain(classes, name: str) -> list[ast.ClassDef]:
    """name's class and its ancestors that are defined under sglang/srt/models, nearest first."""
    out = []
    while name in classes:
        node = classes[name][1]
        out.append(node)
        name = next((b for b in map(_name, node.bases) if b in classes), None)
    return out


def _defines(node: ast.ClassDef, method: str) -> bool:
    return any(isinstance(n, ast.FunctionDef) and n.name == method for n in node.body)


def test_every_deepseek_v2_model_class_of_the_wheel_is_classified(sglang_wheel):
    """A class that subclasses or wraps DeepseekV2ForCausalLM is either supported (and its path is
    the one eyas tests) or listed as unsupported with a reason; a new one in a later SGLang fails
    here."""
    manifest = json.loads((SET_DIR / "manifest.json").read_text())
    supported, unsupported = set(manifest["architectures"]), manifest["unsupported_architectures"]
    assert not supported & set(unsupported) and all(unsupported.values())
    classes, entries = _wheel_models(sglang_wheel)
    family = _deepseek_family(classes)
    served = {name for name in family if name in entries}  # what the model registry can build
    unclassified = {name: family[name] for name in served - supported - set(unsupported)}
    assert not unclassified, f"classify these in {SET_DIR / 'manifest.json'}: {unclassified}"
    assert supported | set(unsupported) <= served, (
        "the manifest names classes the wheel does not serve"
    )

    base = classes["DeepseekV2ForCausalLM"][1]
    assert _defines(base, "forward") and _defines(base, "set_eagle3_layers_to_capture")
    for name in sorted(supported):
        chain = _chain(classes, name)
        if family[name].startswith(
            "builds"
        ):  # a wrapper: its call path is driven in the hook tests
            assert name in DRIVEN_WRAPPERS, f"{name} is a wrapper no test drives"
            assert _defines(chain[0], "set_eagle3_layers_to_capture")
            continue
        # a subclass runs DeepseekV2ForCausalLM's own __init__, forward and capture switch (patched)
        below = chain[: [n.name for n in chain].index("DeepseekV2ForCausalLM")]
        for node in below:
            for method in ("__init__", "forward", "set_eagle3_layers_to_capture"):
                assert not _defines(node, method), f"{node.name} overrides {method}: check its path"
    for name, reason in unsupported.items():
        if NO_EAGLE3 in reason:  # SGLang's model runner refuses aux capture for it at startup
            assert not any(
                _defines(n, "set_eagle3_layers_to_capture") for n in _chain(classes, name)
            ), name
        else:
            assert reason.startswith("draft model") and name.endswith(("NextN", "Eagle")), name


# ---------------------------------------------------------------------------------------------
# Over SSH, against a real sshd on loopback
# ---------------------------------------------------------------------------------------------


@pytest.mark.ssh
def test_the_same_over_ssh(tmp_path, sglang_wheel, sshd):
    host_cfg = dict(
        kind="ssh",
        name="loopback",
        hostname="127.0.0.1",
        port=sshd.port,
        user=sshd.user,
        key_filename=str(sshd.client_key),
        known_hosts=str(sshd.known_hosts),
        connect_timeout_s=5,
    )
    site = make_site(tmp_path, sglang_wheel)
    cfg = sglang_config(tmp_path, site, host_cfg)
    original = (site / DSV2).read_bytes()
    host = SSHHost(cfg.server.host)
    try:
        assert ensure_patched(host, cfg).status == "patched"
        assert (site / HOOK).read_bytes() == (PATCHES_DIR / HOOK).read_bytes()
        py_compile.compile(str(site / DSV2), cfile=str(tmp_path / "dsv2.pyc"), doraise=True)
        assert ensure_patched(host, cfg).status == "already patched"
        assert reverse_patch(host, cfg).status == "reversed"
        assert (site / DSV2).read_bytes() == original and not (site / HOOK).exists()

        (site / DSV2).write_bytes(original + b"# drift\n")
        with pytest.raises(PatchError, match=re.escape(f"[loopback] {site / DSV2} has sha256")):
            ensure_patched(host, cfg)

        other = make_site(tmp_path / "old", sglang_wheel, version="0.5.22")
        with pytest.raises(PatchError, match="sglang 0.5.22 has no eyas patch set"):
            ensure_patched(host, sglang_config(tmp_path, other, host_cfg))
    finally:
        host.close()
