"""The target as this machine's copy describes it: its config.json read and checked against
target.layer_ids, against the architectures server.backend serves, and against the checkpoint the
server host loads."""

from __future__ import annotations

import itertools
import json
import shlex
from pathlib import Path

from eyas.config import PipelineConfig, TargetConfig
from eyas.layers import eagle_config_capture_ids
from eyas.preflight.hosts import run_on

# eyas/local/engine.py builds the model with transformers' AutoModelForCausalLM and captures the
# states of DeepSeek-V3's decoder layers (its expert weights fused the DeepSeek-V3 way).
LOCAL_ARCHITECTURES = ("DeepseekV3ForCausalLM",)


def target_field(cfg: PipelineConfig) -> str:
    """The field naming this machine's copy of the target: target.local_dir, else
    target.checkpoint."""
    t = cfg.target
    return (
        f"target.local_dir={t.local_dir}"
        if t.local_dir is not None
        else f"target.checkpoint={t.checkpoint}"
    )


def read_target(
    cfg: PipelineConfig, problems: list[str], notes: list[str]
) -> tuple[dict | None, dict | None]:
    """(config.json as written, the text config eyas reads) from the target's local copy
    (target.local_dir, else target.checkpoint), or Nones with the problem recorded."""
    from eyas.target import local_copy, read_config

    folder, where = local_copy(cfg.target), target_field(cfg)
    remote = cfg.server.host.kind == "ssh" and cfg.target.local_dir is None
    try:
        tcfg = read_config(folder)
        raw = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError) as e:
        hint = (
            f"; the server host {cfg.server.host.hostname} is reached over SSH: set "
            f"target.local_dir to this "
            f"machine's copy of the target's config.json, tokenizer files and chat template "
            f"(no weights)"
            if remote
            else ""
        )
        problems.append(
            f"{where}: {e} (prepare-data, preflight and the export read the target's config.json "
            f"and tokenizer on this machine{hint})"
        )
        return None, None
    if remote:
        notes.append(
            f"target.local_dir=None: the target's config and tokenizer are read at "
            f"target.checkpoint={cfg.target.checkpoint} on this machine (the same path as on "
            f"{cfg.server.host.hostname})"
        )
    missing = [
        k
        for k in ("num_hidden_layers", "hidden_size", "vocab_size")
        if not isinstance(tcfg.get(k), int)
    ]
    if missing:
        where_in = "text_config" if "text_config" in raw else "config.json"
        problems.append(f"{where}: its {where_in} has no integer {', '.join(missing)}")
        return raw, None
    return raw, tcfg


#: what the orchestrator's copy of the target must agree on with the checkpoint the server loads
NODE_CONFIG_KEYS = ("hidden_size", "num_hidden_layers", "vocab_size")


def node_config_problems(cfg: PipelineConfig, raw: dict) -> list[str]:
    """This machine's copy of config.json (raw) against the checkpoint's on the SSH server host:
    architectures, hidden size, layers and vocabulary (the text config's when nested)."""
    ckpt = cfg.target.checkpoint
    problems: list[str] = []
    r = run_on(
        cfg.server.host,
        "server.host",
        f"cat {shlex.quote(str(ckpt).rstrip('/') + '/config.json')}",
        problems,
    )
    if r is None:
        return problems
    host = cfg.server.host.hostname
    if not r.ok:
        return [
            f"target.checkpoint={ckpt}: no config.json there on {host} (exit {r.exit_code}): "
            f"{r.stderr.strip()[-300:]}"
        ]
    try:
        theirs = json.loads(r.stdout)
    except ValueError as e:
        return [f"target.checkpoint={ckpt}: its config.json on {host} is not JSON ({e})"]

    def summary(c: dict) -> dict:
        text = c.get("text_config", c) if "hidden_size" not in c else c
        archs = c.get("architectures") or text.get("architectures")
        return {"architectures": archs, **{k: text.get(k) for k in NODE_CONFIG_KEYS}}

    ours, node = summary(raw), summary(theirs)
    differ = [f"{k} {ours[k]} here, {node[k]} there" for k in ours if ours[k] != node[k]]
    if differ:
        problems.append(
            f"{target_field(cfg)}: its config.json is not the target's: "
            f"target.checkpoint={ckpt} on "
            f"{host} has another ({'; '.join(differ)}); copy the checkpoint's "
            f"config.json, tokenizer files and chat template here again"
        )
    return problems


def layer_id_problems(target: TargetConfig, num_layers: int) -> list[str]:
    """target.layer_ids against a target of num_layers decoder layers (capture-before, sglang.md
    section 1)."""
    ids, capture = list(target.layer_ids), target.capture_ids()
    where = f"target.layer_ids={ids}"
    if target.layer_convention == "output-of":
        where += f" (target.layer_convention=output-of: capture ids {capture})"
    out = []
    if len(ids) != 3:
        out.append(f"{where}: SGLang's EAGLE-3 drafter fuses exactly 3 layers, got {len(ids)}")
    if any(b <= a for a, b in itertools.pairwise(ids)):
        out.append(f"{where}: the ids must be strictly increasing")
    bad = [i for i in capture if not 1 <= i <= num_layers - 1]
    if bad:
        out.append(
            f"{where}: capture id(s) {bad} out of range for the target's {num_layers} "
            f"layers: capture id i "
            f"is the input of decoder layer i, so ids go from 1 to {num_layers - 1} (the "
            f"last layer's output is the final norm's input, which SGLang cannot capture)"
        )
    elif (read := eagle_config_capture_ids(capture)) != capture:
        out.append(
            f"{where}: capture ids starting with 1 are read by SGLang as output-of ids and "
            f"shifted to {read}; choose a first capture id of 2 or more"
        )
    return out


def architecture_problems(
    cfg: PipelineConfig, raw: dict, version: str | None, patches_dir: Path
) -> list[str]:
    """The target's architecture against what the backend serves: the patch set's manifest for
    SGLang (the patch stage's own check, eyas/server/sglang_patch.py), DeepSeek-V3 for
    eyas-local."""
    from eyas.server.patch_sets import PatchError, available_versions, check_architecture

    archs = raw.get("architectures") or (raw.get("text_config") or {}).get("architectures") or []
    source = f"{target_field(cfg)} (config.json)"
    if cfg.server.backend == "local":
        if archs and archs[0] in LOCAL_ARCHITECTURES:
            return []
        return [
            f"{source}: architectures {archs or 'missing'} cannot be served by "
            f"server.backend=local (eyas's local server loads {list(LOCAL_ARCHITECTURES)})"
        ]
    versions = [version] if version else available_versions(patches_dir)
    problems = []
    for v in versions:  # without the host's version: every patch set eyas ships must take it
        try:
            check_architecture(v, archs, source, patches_dir, capture=cfg.server.capture)
        except PatchError as e:
            problems.append(f"{e} (server.backend=sglang)")
            break  # one refusal is the answer; the other versions' would say the same again
        except (OSError, ValueError):
            continue  # no patch set for that version: the host check reports it
    return problems
