"""SGLang patch sets: what eyas installs for each SGLang version, read and checked on this machine.

    pset = load_patch_set("0.5.23")        # patches/sglang/0.5.23/: manifest, hook, source patch
    check_architecture(pset, ["KimiK25ForConditionalGeneration"], "config.json")
    text = apply_diff(original, pset.files[0].diff, name=...)

The patch stage (eyas/server/sglang_patch.py) installs a patch set on a host; preflight
(eyas/preflight/target.py) checks a target's architecture against it before any GPU is touched.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from eyas.errors import EyasError
from eyas.files import sha256_bytes
from eyas.resources import shipped
from eyas.server.diffs import DiffError, parse_diff
from eyas.server.diffs import apply_diff as _apply

PATCHES_DIR = shipped(
    "patches", "sglang"
)  #: one folder per SGLang version, each with manifest.json
DUMP_SOURCE = (
    Path(__file__).resolve().parents[1] / "dump.py"
)  # eyas/dump.py, copied as eyas_dump.py
DUMP_MODULE = "eyas_dump.py"  #: how eyas/dump.py is installed beside the hook


class PatchError(EyasError, RuntimeError):
    """The server host is in a state eyas will not patch; names the host, file or version."""


def apply_diff(text: str, diff: str, *, reverse: bool = False, name: str = "<file>") -> str:
    """text with diff applied (or un-applied); PatchError if any hunk does not match exactly."""
    try:
        return _apply(text, diff, reverse=reverse, name=name)
    except DiffError as e:
        raise PatchError(str(e)) from e


# ---------------------------------------------------------------------------------------------
# Patch sets: patches/sglang/<version>/manifest.json
# ---------------------------------------------------------------------------------------------


@dataclass
class PatchedFile:
    path: str  # relative to site-packages, e.g. sglang/srt/models/deepseek_v2.py
    diff: str
    original_sha256: str
    patched_sha256: str


@dataclass
class PatchSet:
    sglang_version: str
    patch_version: str
    files: list[PatchedFile]
    modules: dict[str, bytes]  # file name in site-packages -> bytes (hook + dump writer)
    #: model classes (config.json `architectures`) whose capture path the patch set supports
    architectures: list[str] = field(default_factory=list)
    #: known classes of the same family it does not support -> why
    unsupported_architectures: dict[str, str] = field(default_factory=dict)
    #: further classes whose forward hands aux hidden states to the logits processor as the hook
    #: reads them: supported with server.capture forward_hook only (the source patch is DeepSeek's)
    hook_architectures: list[str] = field(default_factory=list)
    #: SGLang has --enable-return-aux-hidden-states; without it (0.5.18) the capture launch loads a
    #: stub EAGLE-3 draft that names the layers (eyas/server/capture_draft.py)
    capture_only_mode: bool = True


def hook_source(module: str, patches_dir: Path = PATCHES_DIR) -> Path:
    """The hook module's source: one file beside the version folders, shared by every patch set."""
    return Path(patches_dir) / module


def available_versions(patches_dir: Path = PATCHES_DIR) -> list[str]:
    """SGLang versions this eyas has a patch set for."""
    return sorted(p.parent.name for p in Path(patches_dir).glob("*/manifest.json"))


def load_patch_set(version: str, patches_dir: Path = PATCHES_DIR) -> PatchSet:
    """The patch set for one SGLang version, with its files checked against the manifest."""
    folder = Path(patches_dir) / version
    if not (folder / "manifest.json").is_file():
        raise PatchError(
            f"sglang {version} has no eyas patch set (patch sets exist for: "
            f"{', '.join(available_versions(patches_dir)) or 'none'}; see {patches_dir})"
        )
    manifest = json.loads((folder / "manifest.json").read_text())
    if manifest["sglang_version"] != version:
        raise PatchError(
            f"{folder}/manifest.json is for sglang {manifest['sglang_version']}, not {version}"
        )
    hook = manifest["hook"]
    hook_path = hook_source(hook["module"], patches_dir)
    hook_bytes = hook_path.read_bytes()
    if sha256_bytes(hook_bytes) != hook["sha256"]:
        raise PatchError(
            f"{hook_path} has sha256 {sha256_bytes(hook_bytes)}, {folder}/manifest.json says "
            f"{hook['sha256']}: run patches/sglang/refresh_manifest.py after editing it"
        )
    files = [
        PatchedFile(
            f["path"], (folder / f["patch"]).read_text(), f["original_sha256"], f["patched_sha256"]
        )
        for f in manifest["files"]
    ]
    for f, entry in zip(files, manifest["files"]):
        target, _ = parse_diff(f.diff)
        if target != f.path:
            raise PatchError(
                f"{folder / entry['patch']} patches {target}, its manifest says {f.path}"
            )
    modules = {hook["module"]: hook_bytes, DUMP_MODULE: DUMP_SOURCE.read_bytes()}
    if not manifest.get("architectures"):
        raise PatchError(f"{folder}/manifest.json lists no supported architectures")
    return PatchSet(
        version,
        manifest["patch_version"],
        files,
        modules,
        list(manifest["architectures"]),
        dict(manifest.get("unsupported_architectures", {})),
        list(manifest.get("hook_architectures", [])),
        bool(manifest.get("capture_only_mode", True)),
    )


def check_architecture(
    manifest_or_version: PatchSet | dict | str,
    architectures: list[str] | None,
    source: str,
    patches_dir: Path = PATCHES_DIR,
    capture: str = "forward_hook",
) -> str:
    """The architecture SGLang will serve, if the patch set supports it; PatchError otherwise.

    `manifest_or_version`: a PatchSet, a parsed manifest.json, or an SGLang version (its patch set
    is read from patches_dir). `architectures`: the target config.json's list; SGLang's registry
    (models/registry.py:resolve_model_cls) builds the class named first. `source` names where the
    list came from (the config file) for the message. `capture` (server.capture): with
    "forward_hook" the manifest's hook_architectures are supported too.
    """
    if isinstance(manifest_or_version, str):
        manifest_or_version = load_patch_set(manifest_or_version, patches_dir)
    if isinstance(manifest_or_version, PatchSet):
        pset = manifest_or_version
        version, patch_version = pset.sglang_version, pset.patch_version
        supported, unsupported = pset.architectures, pset.unsupported_architectures
        hook_only = pset.hook_architectures
    else:
        version, patch_version = (
            manifest_or_version["sglang_version"],
            manifest_or_version["patch_version"],
        )
        supported = manifest_or_version.get("architectures") or []
        unsupported = manifest_or_version.get("unsupported_architectures", {})
        hook_only = manifest_or_version.get("hook_architectures", [])
    if capture == "forward_hook":
        supported = [*supported, *hook_only]
    elif hook_only:
        unsupported = {
            **{
                a: "supported through the forward hook only (server.capture: "
                "forward_hook): "
                "the source patch changes DeepSeek-V2's model "
                "file"
                for a in hook_only
            },
            **unsupported,
        }
    if isinstance(architectures, str):
        architectures = [architectures]
    if not architectures:
        raise PatchError(
            f"{source} names no architectures; eyas patch set {patch_version} (sglang "
            f"{version}) supports: {', '.join(supported)}"
        )
    arch = architectures[0]
    if arch not in supported:
        why = f" ({unsupported[arch]})" if arch in unsupported else ""
        raise PatchError(
            f"{source}: architecture {arch} is not supported by eyas patch set "
            f"{patch_version} (sglang {version}){why}; supported: {', '.join(supported)}"
        )
    return arch
