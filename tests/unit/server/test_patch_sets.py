"""The shipped SGLang patch sets: a diff applied strictly (PatchError, the patch stage's error), and
the architectures a set supports (the patch stage against the real wheel:
tests/integration/test_sglang_patch.py)."""

from __future__ import annotations

import difflib
import json

import pytest

from eyas.server import patch_sets
from eyas.server.patch_sets import PATCHES_DIR, PatchError, apply_diff
from tests.sglang_wheel import TARGET_ARCH, VERSION

SET_DIR = PATCHES_DIR / VERSION


def test_apply_diff_is_strict_and_reversible():
    old = "a\nb\nc\nd\n"
    new = "a\nb\nB2\nc\nd"  # also drops the final newline
    diff = "".join(
        difflib.unified_diff(old.splitlines(True), new.splitlines(True), "a/f.py", "b/f.py")
    )
    diff = diff.replace("+d", "+d\n\\ No newline at end of file")
    assert apply_diff(old, diff) == new
    assert apply_diff(new, diff, reverse=True) == old
    with pytest.raises(PatchError, match="does not match"):
        apply_diff(new, diff)  # already applied: the context no longer matches
    with pytest.raises(PatchError, match="does not match"):
        apply_diff(old.replace("b", "x"), diff)


def test_check_architecture_takes_a_version_a_manifest_or_a_patch_set():
    manifest = json.loads((SET_DIR / "manifest.json").read_text())
    for given in (VERSION, manifest, patch_sets.load_patch_set(VERSION)):
        assert patch_sets.check_architecture(given, [TARGET_ARCH], "x/config.json") == TARGET_ARCH
        with pytest.raises(
            PatchError,
            match=r"^x/config.json: architecture DeepseekVL2ForCausalLM "
            r"is "
            r"not supported .*attention_backend_setup",
        ):
            patch_sets.check_architecture(given, ["DeepseekVL2ForCausalLM"], "x/config.json")
    with pytest.raises(PatchError, match="sglang 0.5.22 has no eyas patch set"):
        patch_sets.check_architecture("0.5.22", [TARGET_ARCH], "x/config.json")


def test_the_shipped_versions_are_the_folders_with_a_manifest(tmp_path):
    assert VERSION in patch_sets.available_versions()
    (tmp_path / "0.1.0").mkdir()
    (tmp_path / "0.1.0" / "manifest.json").write_text("{}")
    (tmp_path / "notes").mkdir()  # no manifest: not a patch set
    assert patch_sets.available_versions(tmp_path) == ["0.1.0"]
