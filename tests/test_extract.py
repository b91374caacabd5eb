import random

import pytest
import torch

from eyas import readiness
from eyas.data import TokenizedSample, write_shard_plans
from eyas.extract import ExtractionError, existing_shard, extract_shard, shard_path
from eyas.hosts import LocalHost
from eyas.launch import start_server, stop_server
from eyas.shards import ShardReader
from tests.stage_config import stage_config


@pytest.fixture(scope="module")
def server(tmp_path_factory, random_target):
    tmp = tmp_path_factory.mktemp("extract")
    host, cfg = LocalHost(), stage_config(tmp, random_target, **{"server.env": {"OMP_NUM_THREADS": "1"}})
    handle = start_server(host, cfg)
    s = cfg.sensor
    readiness.wait_until_ready(host, log_path=handle.log_path, pid=handle.pid, url=handle.url,
                               start_offset=handle.log_offset, poll_interval_s=0.1, stall_timeout_s=30,
                               deadline_s=120, http_timeout_s=5)
    yield cfg, handle
    stop_server(host, cfg, handle.pid)


def _plans(tmp, n=6, seed=0):
    rng = random.Random(seed)
    samples = []
    for _ in range(n):
        length = rng.randint(5, 40)  # chunked-prefill-size is 16: most are 2-3 chunks
        samples.append(TokenizedSample([rng.randrange(3, 512) for _ in range(length)],
                                       [0] * (length // 2) + [1] * (length - length // 2)))
    return samples, write_shard_plans(samples, 2, tmp / "plan")


def _extract(cfg, plan, out, **kw):
    args = dict(server_url=cfg.server.url, dump_dir=cfg.server.dump_dir, capture_ids=[2, 4, 5],
                dtype="bfloat16", concurrency=3, request_timeout_s=60, record_timeout_s=10,
                meta={"cache_key": "k1", "layer_ids": [2, 4, 5], "layer_convention": "capture-before"})
    return extract_shard(plan, out, **{**args, **kw})


def test_shard_holds_the_targets_hidden_states(server, tmp_path, random_target):
    import transformers

    cfg, _ = server
    samples, plans = _plans(tmp_path)
    manifests = [_extract(cfg, p, tmp_path / "out") for p in plans]
    assert sum(m["num_samples"] for m in manifests) == len(samples)
    assert manifests[0]["last_hidden_norm"] == "post"
    model = transformers.AutoModelForCausalLM.from_pretrained(random_target, dtype=torch.float32).eval()
    reader = ShardReader(shard_path(tmp_path / "out", plans[0]))
    for planned, got in zip(samples, reader):
        assert got.input_ids.tolist() == planned.input_ids
        with torch.no_grad():
            hs = model(torch.tensor([planned.input_ids]), output_hidden_states=True).hidden_states
        aux = torch.cat([hs[2][0], hs[4][0], hs[5][0]], dim=-1)
        torch.testing.assert_close(got.aux_hidden_states.float(), aux, atol=2e-2, rtol=2e-2)
        torch.testing.assert_close(got.last_hidden_state.float(), hs[-1][0], atol=2e-2, rtol=2e-2)
    assert list(cfg.server.dump_dir.iterdir()) == []  # records are removed once collected


def test_intact_shard_is_reused_and_damaged_one_is_not(server, tmp_path):
    cfg, _ = server
    _, plans = _plans(tmp_path, seed=1)
    m = _extract(cfg, plans[0], tmp_path / "out")
    assert existing_shard(tmp_path / "out", plans[0], "k1")["sha256"] == m["sha256"]
    assert existing_shard(tmp_path / "out", plans[0], "other-key") is None
    path = shard_path(tmp_path / "out", plans[0])
    path.write_bytes(path.read_bytes()[:-64])
    assert existing_shard(tmp_path / "out", plans[0], "k1") is None


def test_wrong_capture_layers_are_refused_and_nothing_is_written(server, tmp_path):
    cfg, _ = server
    _, plans = _plans(tmp_path, seed=2)
    with pytest.raises(ExtractionError, match=r"captured layers \[2, 4, 5\]"):
        _extract(cfg, plans[0], tmp_path / "out", capture_ids=[1, 4, 6])
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").glob("*.safetensors"))


def test_server_gone_is_an_error_naming_the_shard(tmp_path):
    samples = [TokenizedSample([5, 6, 7], [0, 1, 1])]
    plan = write_shard_plans(samples, 1, tmp_path / "plan")[0]
    with pytest.raises(ExtractionError, match="shard-00000 sequence 0"):
        extract_shard(plan, tmp_path / "out", server_url="http://127.0.0.1:9", dump_dir=tmp_path / "d",
                      capture_ids=[2, 4, 5], dtype="bfloat16", concurrency=1, request_timeout_s=2,
                      record_timeout_s=1, meta={})
    assert not any((tmp_path / "out").glob("*")) if (tmp_path / "out").exists() else True
