"""The local server's engine in process: the shard-by-shard loader against from_pretrained, chunked
prefill against one forward, SGLang's capture ids, and the fused expert layout."""

from __future__ import annotations

import pytest
import torch

from eyas.dump import assemble, read_records
from eyas.local.engine import Engine, fuse_experts, load_model, resolve_capture_ids
from tests.local_reference import prompt, reference_model

CAPTURE = [2, 4, 6]


@pytest.fixture(scope="module")
def reference(random_target):
    return reference_model(random_target)


def test_shard_loader_matches_from_pretrained(random_target, reference, tmp_path):
    model = load_model(random_target)
    ids = torch.tensor([prompt(9, seed=6)])
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, reference(ids).logits, rtol=0, atol=0)
    # chunk sizes that do and do not divide the prompt, against one unchunked forward
    from eyas.dump import DumpWriter

    ids = prompt(23, seed=7)
    whole = None
    for chunk in (-1, 1, 5, 16):
        writer = DumpWriter(tmp_path / str(chunk), layer_ids=CAPTURE, dtype=torch.float32)
        engine = Engine(model, None, chunk_size=chunk, writer=writer, capture_ids=CAPTURE)
        engine.prefill(ids, "r")
        sample = assemble(read_records(tmp_path / str(chunk), "r"), ids)
        assert sample.meta["num_chunks"] == (1 if chunk == -1 else -(-23 // chunk))
        if whole is None:
            whole = sample
        torch.testing.assert_close(
            sample.aux_hidden_states, whole.aux_hidden_states, rtol=1e-4, atol=1e-5
        )
        torch.testing.assert_close(
            sample.last_hidden_state, whole.last_hidden_state, rtol=1e-4, atol=1e-5
        )


def test_capture_ids_follow_sglang():
    assert resolve_capture_ids(None, 61) == [2, 30, 58]
    assert resolve_capture_ids([1, 29, 57], 61) == [
        2,
        30,
        58,
    ]  # output-of ids, shifted as SGLang does
    assert resolve_capture_ids([3, 31, 59], 61) == [3, 31, 59]
    with pytest.raises(ValueError, match="aux layer id 61 out of range"):
        resolve_capture_ids([2, 61], 61)


def test_fuse_experts_layout():
    e0g, e0u, e1g, e1u = (torch.full((2, 3), float(v)) for v in range(4))
    state = {
        "m.experts.0.gate_proj.weight": e0g,
        "m.experts.0.up_proj.weight": e0u,
        "m.experts.1.gate_proj.weight": e1g,
        "m.experts.1.up_proj.weight": e1u,
        "m.experts.0.down_proj.weight": torch.zeros(3, 2),
        "m.experts.1.down_proj.weight": torch.ones(3, 2),
    }
    out = fuse_experts(state, {"m.experts.gate_up_proj", "m.experts.down_proj"})
    assert out["m.experts.gate_up_proj"].shape == (2, 4, 3) and out[
        "m.experts.down_proj"
    ].shape == (2, 3, 2)
    assert (
        out["m.experts.gate_up_proj"][1, :2].eq(2).all()
        and out["m.experts.gate_up_proj"][1, 2:].eq(3).all()
    )
