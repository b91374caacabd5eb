import json

import pytest
import torch

from eyas.shards import Sample, ShardError, ShardReader, ShardWriter, manifest_path, verify_shard, write_shard


def make_samples(lengths, H=8, K=3, dtype=torch.bfloat16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [Sample(torch.randint(0, 100, (n,), generator=g), torch.rand(n, generator=g) > 0.5,
                   torch.randn(n, K * H, generator=g).to(dtype), torch.randn(n, H, generator=g).to(dtype))
            for n in lengths]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_round_trip_bit_exact(tmp_path, dtype):
    samples = make_samples([5, 1, 17], dtype=dtype)
    manifest = write_shard(tmp_path / "shard-00000.safetensors", samples, {"layer_ids": [2, 4, 5]})
    assert manifest["num_samples"] == 3 and manifest["num_tokens"] == 23
    r = ShardReader(tmp_path / "shard-00000.safetensors")
    assert len(r) == 3 and r.hidden_size == 8 and r.num_aux == 3 and r.meta["layer_ids"] == [2, 4, 5]
    for a, b in zip(samples, r):
        assert torch.equal(a.input_ids, b.input_ids) and torch.equal(a.loss_mask, b.loss_mask)
        assert torch.equal(a.aux_hidden_states, b.aux_hidden_states)
        assert torch.equal(a.last_hidden_state, b.last_hidden_state)
        assert b.aux_hidden_states.dtype == dtype


def test_samples_may_arrive_in_any_order(tmp_path):
    samples = make_samples([3, 4, 5])
    w = ShardWriter(tmp_path / "s.safetensors", [3, 4, 5], hidden_size=8, num_aux=3,
                    dtype=torch.bfloat16, meta={})
    for i in (2, 0, 1):
        w.put(i, samples[i])
    w.close()
    assert torch.equal(ShardReader(tmp_path / "s.safetensors").sample(2).aux_hidden_states,
                       samples[2].aux_hidden_states)


def test_incomplete_shard_is_never_published(tmp_path):
    samples = make_samples([3, 4])
    w = ShardWriter(tmp_path / "s.safetensors", [3, 4], hidden_size=8, num_aux=3, dtype=torch.bfloat16, meta={})
    w.put(0, samples[0])
    with pytest.raises(ShardError, match="never written"):
        w.close()
    assert list(tmp_path.iterdir()) == []


def test_wrong_shape_is_refused(tmp_path):
    w = ShardWriter(tmp_path / "s.safetensors", [3], hidden_size=8, num_aux=3, dtype=torch.bfloat16, meta={})
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
