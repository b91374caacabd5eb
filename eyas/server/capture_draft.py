"""The stub EAGLE-3 draft that makes an SGLang without capture-only mode capture hidden states.

    folder = f"{workdir}/{FOLDER}"   # <server.workdir>/capture-draft
    install_capture_draft(host, folder, target_config, capture_ids, architecture)
    capture_draft_args(folder)   # --speculative-algorithm EAGLE3 --speculative-draft-model-path ...

SGLang 0.5.18 has no `--enable-return-aux-hidden-states`: its target keeps aux hidden states only
for a loaded EAGLE-3 draft, and takes the layers to capture from the draft's
`eagle_config.eagle_aux_hidden_state_layer_ids` (spec_aux_hidden_state.py, then the target class's
set_eagle3_layers_to_capture, whose id rule eyas_dump.server_layer_ids inverts). So the capture
launch there loads this draft: SGLang's checkpoint format (eyas/draft_format.py) at the target's
hidden size with the smallest draft vocabulary, seeded random weights, and the capture layers in
its eagle_config. Its drafts are never used: extraction asks for one new token per request. Each
head is 64 wide (32 where the hidden size allows no more), a width SGLang's CPU attention kernels
take, as a GPU's do.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import torch
from safetensors.torch import save_file

from eyas.draft_format import DrafterConfig, expected_weights, sglang_config
from eyas.errors import InvalidInput
from eyas.layers import server_layer_ids
from eyas.server.hosts import Host

FOLDER = "capture-draft"  #: under server.workdir on the server host
DRAFT_VOCAB = 32  # the draft vocabulary's size: its proposals are never looked at
#: one draft step of one token: the least speculative work per forward
SPECULATIVE_ARGS = [
    "--speculative-num-steps",
    "1",
    "--speculative-eagle-topk",
    "1",
    "--speculative-num-draft-tokens",
    "2",
]


def draft_shape(target_config: dict) -> DrafterConfig:
    """The stub's shape for a target config.json (a multimodal wrapper's text_config is read)."""
    text = target_config.get("text_config") or target_config
    hidden, vocab = int(text["hidden_size"]), int(text["vocab_size"])
    head_dim = 64 if hidden % 64 == 0 else 32
    if hidden % head_dim:
        raise InvalidInput(
            f"target hidden_size {hidden} is not a multiple of 32: no capture draft fits it"
        )
    heads = hidden // head_dim
    return DrafterConfig(
        hidden_size=hidden,
        target_hidden_size=hidden,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        head_dim=head_dim,
        intermediate_size=hidden,
        vocab_size=vocab,
        draft_vocab_size=min(DRAFT_VOCAB, vocab),
        max_position_embeddings=int(text.get("max_position_embeddings", 2048)),
    )


def capture_draft(
    target_config: dict, capture_ids: list[int], architecture: str | None
) -> tuple[dict, dict[str, torch.Tensor]]:
    """(config.json, weights) of the stub draft whose eagle_config makes `architecture` capture
    the capture-before layers `capture_ids`."""
    dcfg = draft_shape(target_config)
    gen = torch.Generator().manual_seed(0)
    weights = {}
    for name, (shape, fixed) in expected_weights(dcfg).items():
        if fixed is not None:
            continue
        if name.endswith("norm.weight"):
            weights[name] = torch.ones(shape, dtype=torch.bfloat16)
        else:
            weights[name] = (torch.randn(shape, generator=gen) * 0.02).to(torch.bfloat16)
    weights["d2t"] = torch.zeros(dcfg.draft_vocab_size, dtype=torch.int64)  # draft id i is token i
    t2d = torch.zeros(dcfg.vocab_size, dtype=torch.bool)
    t2d[: dcfg.draft_vocab_size] = True
    weights["t2d"] = t2d
    ids = server_layer_ids(capture_ids, architecture)
    config = sglang_config(
        dcfg,
        ids,
        "bfloat16",
        provenance={
            "purpose": "capture draft: makes the target capture these layers; its drafts are "
            "unused",
            "capture_ids": list(capture_ids),
        },
    )
    return config, weights


def install_capture_draft(
    host: Host,
    folder: str,
    target_config: dict,
    capture_ids: list[int],
    architecture: str | None,
) -> None:
    """Write the stub draft to `folder` on the server host (<server.workdir>/capture-draft)."""
    config, weights = capture_draft(target_config, capture_ids, architecture)
    with tempfile.TemporaryDirectory(prefix="eyas-capture-draft-") as tmp:
        save_file(weights, str(Path(tmp) / "model.safetensors"), metadata={"format": "pt"})
        (Path(tmp) / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        # put writes each file beside its destination and renames it: never a half-written file
        for name in ("model.safetensors", "config.json"):
            host.put(Path(tmp) / name, f"{folder}/{name}")


def capture_draft_args(folder: str) -> list[str]:
    """The launch flags that load the stub draft."""
    return [
        "--speculative-algorithm",
        "EAGLE3",
        "--speculative-draft-model-path",
        folder,
        *SPECULATIVE_ARGS,
    ]
