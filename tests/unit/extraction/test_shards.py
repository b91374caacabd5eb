"""Shard files: written and read back bit-exact, checked against their manifests."""

import json

import pytest
import torch

from eyas.extraction.shards import (
    Sample,
    ShardError,
    ShardManifest,
    ShardReader,
    ShardWriter,
    manifest_path,
    verify_shard,
    write_shard,
)


def make_samples(lengths, H=8, K=3, dtype=torch.bfloat16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [
        Sample(
            torch.randint(0, 100, (n,), generator=g),
            torch.rand(n, generator=g) > 0.5,
            torch.randn(n, K * H, generator=g).to(dtype),
            torch.randn(n, H, generator=g).to(dtype),
        )
        for n in lengths
    ]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_round_trip_bit_exact(tmp_path, dtype):
    samples = make_samples([5, 1, 17], dtype=dtype)
    manifest = write_shard(tmp_path / "shard-00000.safetensors", samples, {"layer_ids": [2, 4, 5]})
    assert manifest["num_samples"] == 3 and manifest["num_tokens"] == 23
    r = ShardReader(tmp_path / "shard-00000.safetensors")
    assert (
        len(r) == 3 and r.hidden_size == 8 and r.num_aux == 3 and r.meta["layer_ids"] == [2, 4, 5]
    )
    for a, b in zip(samples, r):
        assert torch.equal(a.input_ids, b.input_ids) and torch.equal(a.loss_mask, b.loss_mask)
        assert torch.equal(a.aux_hidden_states, b.aux_hidden_states)
        assert torch.equal(a.last_hidden_state, b.last_hidden_state)
        assert b.aux_hidden_states.dtype == dtype


def test_samples_may_arrive_in_any_order(tmp_path):
    samples = make_samples([3, 4, 5])
    w = ShardWriter(
        tmp_path / "s.safetensors",
        [3, 4, 5],
        hidden_size=8,
        num_aux=3,
        dtype=torch.bfloat16,
        meta={},
    )
    for i in (2, 0, 1):
        w.put(i, samples[i])
    w.close()
    assert torch.equal(
        ShardReader(tmp_path / "s.safetensors").sample(2).aux_hidden_states,
        samples[2].aux_hidden_states,
    )


def test_incomplete_shard_is_never_published(tmp_path):
    samples = make_samples([3, 4])
    w = ShardWriter(
        tmp_path / "s.safetensors", [3, 4], hidden_size=8, num_aux=3, dtype=torch.bfloat16, meta={}
    )
    w.put(0, samples[0])
    with pytest.raises(ShardError, match="never written"):
        w.close()
    assert list(tmp_path.iterdir()) == []


def test_wrong_shape_is_refused(tmp_path):
    w = ShardWriter(
        tmp_path / "s.safetensors", [3], hidden_size=8, num_aux=3, dtype=torch.bfloat16, meta={}
    )
    with pytest.raises(ShardError, match="sample 0"):
        w.put(0, make_samples([4])[0])
    w.abort()


def test_truncated_and_corrupted_shards_are_detected(tmp_path):
    path = tmp_path / "shard-00000.safetensors"
    write_shard(path, make_samples([50, 60]), {})
    assert verify_shard(path)["num_tokens"] == 110
    data = bytearray(path.read_bytes())
    data[-10] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(ShardError, match="sha256"):
        verify_shard(path)
    path.write_bytes(bytes(data[:-100]))
    with pytest.raises(ShardError, match="truncated"):
        verify_shard(path)
    with pytest.raises(ShardError, match="not a readable"):
        ShardReader(path)


def test_manifest_records_size_and_hash(tmp_path):
    path = tmp_path / "shard-00001.safetensors"
    m = write_shard(path, make_samples([4]), {"target_checkpoint": "/m"})
    on_disk = json.loads(manifest_path(path).read_text())
    assert on_disk == m and on_disk["bytes"] == path.stat().st_size and len(on_disk["sha256"]) == 64


def test_fp8_round_trip_returns_bf16_within_the_measured_error(tmp_path):
    from eyas.extraction import fp8

    samples = make_samples([7, 33], H=64)
    for s in samples:  # residual streams: token norms spread over orders of magnitude
        s.aux_hidden_states = (
            s.aux_hidden_states.float() * torch.logspace(-2, 2, len(s))[:, None]
        ).bfloat16()
    m = write_shard(tmp_path / "s.safetensors", samples, {}, encoding="fp8_e4m3")
    r = ShardReader(tmp_path / "s.safetensors")
    assert r.encoding == "fp8_e4m3" and r.hidden_size == 64 and r.num_aux == 3
    for a, b in zip(samples, r):
        assert b.aux_hidden_states.dtype == torch.bfloat16 and torch.equal(a.input_ids, b.input_ids)
        rel = (a.aux_hidden_states.float() - b.aux_hidden_states.float()).norm(
            dim=-1
        ) / a.aux_hidden_states.float().norm(dim=-1)
        assert (
            rel.max() < 0.05
        )  # e4m3: 3 mantissa bits, per-token scale keeps small tokens exact-ish
    err = m["fp8_error"]["aux"]
    assert err["tokens"] == 40 and 0.005 < max(err["rel_rms"]) < 0.04 and err["min_cosine"] > 0.999
    assert m["bytes"] == verify_shard(tmp_path / "s.safetensors")["bytes"]
    # A reader unaware of the encoding finds no aux_hidden_states rather than unscaled values.
    from safetensors import safe_open

    with safe_open(str(tmp_path / "s.safetensors"), "pt") as f:
        assert (
            "aux_hidden_states" not in f.keys()
            and f.get_slice("aux_hidden_states_fp8").get_dtype() == "F8_E4M3"
        )
    q, scale = fp8.quantize(torch.zeros(2, 6), 2)
    assert torch.equal(fp8.dequantize(q, scale), torch.zeros(2, 6))


def test_chunks_from_several_threads_fill_a_shard(tmp_path):
    import threading

    samples = make_samples([40, 25, 9])
    w = ShardWriter(
        tmp_path / "s.safetensors",
        [40, 25, 9],
        hidden_size=8,
        num_aux=3,
        dtype=torch.bfloat16,
        meta={},
    )
    chunks = [(i, a) for i, s in enumerate(samples) for a in range(0, len(s), 8)]

    def put(i, a):
        s = samples[i]
        w.put_rows(
            i,
            a,
            s.input_ids[a : a + 8],
            s.loss_mask[a : a + 8],
            s.aux_hidden_states[a : a + 8],
            s.last_hidden_state[a : a + 8],
        )

    threads = [threading.Thread(target=put, args=c) for c in reversed(chunks)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    w.close()
    for a, b in zip(samples, ShardReader(tmp_path / "s.safetensors")):
        assert torch.equal(a.aux_hidden_states, b.aux_hidden_states) and torch.equal(
            a.input_ids, b.input_ids
        )


def test_a_sample_written_twice_or_past_its_length_is_refused(tmp_path):
    s = make_samples([4])[0]
    w = ShardWriter(
        tmp_path / "s.safetensors", [4], hidden_size=8, num_aux=3, dtype=torch.bfloat16, meta={}
    )
    with pytest.raises(ShardError, match="rows 2..5"):
        w.put_rows(0, 2, s.input_ids, s.loss_mask, s.aux_hidden_states, s.last_hidden_state)
    w.put(0, s)
    with pytest.raises(ShardError, match="written twice"):
        w.put(0, s)
    w.abort()
    assert list(tmp_path.iterdir()) == []


def test_a_manifest_travels_typed_and_writes_back_the_same_file(tmp_path):
    path = tmp_path / "shard-00000.safetensors"
    write_shard(
        path,
        make_samples([5, 3]),
        {"layer_ids": [2, 4, 5], "layer_convention": "capture_before"},
        encoding="fp8_e4m3",
    )
    on_disk = json.loads(manifest_path(path).read_text())
    m = ShardManifest.from_json(verify_shard(path))
    assert (m.file, m.num_samples, m.num_tokens, m.bytes, m.encoding) == (
        path.name,
        2,
        8,
        path.stat().st_size,
        "fp8_e4m3",
    )
    assert m.meta["layer_ids"] == [2, 4, 5] and "fp8_error" in m.meta and not m.reused
    assert m.to_json() == on_disk  # `reused` is the run's, never the file's
    with pytest.raises(ShardError, match=r"shard-00000.safetensors: manifest lacks \['sha256'\]"):
        ShardManifest.from_json({k: v for k, v in on_disk.items() if k != "sha256"})
