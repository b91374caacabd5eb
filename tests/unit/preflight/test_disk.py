"""Preflight weighs the shards' disk: the read rate the planned training speed needs per node, the
shard folder's rate measured by a short probe (page cache dropped), and training.disk_check's warn /
refuse / off."""

from __future__ import annotations

import pytest

from eyas.config import load_config
from eyas.extraction.shards import bytes_per_token
from eyas.preflight import disk, format_preflight, preflight
from tests.stage_config import ROOT

KIMI = ROOT / "fixtures" / "kimi-k2.5"


@pytest.fixture(autouse=True)
def small_probe(monkeypatch):
    monkeypatch.setattr(disk, "DISK_PROBE_BYTES", 8 << 20)  # a few MB: the tests share two cores


def test_the_production_plan_states_the_read_rate_its_training_needs(tmp_path):
    cfg = load_config(
        ROOT / "configs" / "kimi-k2.5-sglang.yaml",
        {
            "target.checkpoint": str(KIMI),
            "target.local_dir": str(KIMI),
            "run_dir": str(tmp_path / "run"),
            "data.path": str(ROOT / "fixtures" / "data" / "conversations.jsonl"),
            "extraction.output_dir": str(tmp_path / "shards"),
            "training.output_dir": str(tmp_path / "train"),
        },
    )
    r = preflight(cfg, check_hosts=False, check_tokenizer=False)
    need = (
        cfg.plan.train_tokens_per_s * 8 * bytes_per_token(7168, 3, "bfloat16")
    )  # 8 GPUs of one node
    assert r.plan.read_bytes_per_s == pytest.approx(need)
    text = format_preflight(r, cfg)
    assert (
        f"reading    {need / 1e9:,.2f} GB/s of shards per training node (8 process(es) x "
        f"plan.train_tokens_per_s=5000 x 57,349 B/token, bfloat16 plain); not probed: host "
        f"checks skipped"
    ) in text
    fp8 = preflight(
        load_config(
            ROOT / "configs" / "kimi-k2.5-sglang.yaml",
            {
                "target.checkpoint": str(KIMI),
                "target.local_dir": str(KIMI),
                "data.path": str(ROOT / "fixtures" / "data" / "conversations.jsonl"),
                "extraction.output_dir": str(tmp_path / "shards"),
                "training.output_dir": str(tmp_path / "train"),
                "run_dir": str(tmp_path / "run"),
                "extraction.encoding": "fp8_e4m3",
            },
        ),
        check_hosts=False,
        check_tokenizer=False,
    )
    assert fp8.plan.read_bytes_per_s < 0.51 * need  # FP8 shards: about half the bytes


def gpu_config(tmp_path, **overrides):
    return load_config(
        ROOT / "configs" / "local-tiny.yaml",
        {
            "run_dir": str(tmp_path / "run"),
            "extraction.output_dir": str(tmp_path / "shards" / "not-yet"),
            "training.output_dir": str(tmp_path / "train"),
            "training.device": "cuda",
            **overrides,
        },
    )


def test_a_disk_slower_than_the_plan_is_noted_or_refused(tmp_path):
    fast = preflight(gpu_config(tmp_path), check_hosts=False, check_tokenizer=False)
    assert fast.plan.disk_bytes_per_s > fast.plan.read_bytes_per_s  # 6000 tokens/s x 2 KB: any disk
    assert "a temp file on this machine, page cache dropped" in fast.plan.disk_probe
    assert (
        not list((tmp_path / "shards").glob(".eyas-disk-probe-*"))
        if (tmp_path / "shards").exists()
        else True
    )
    need = {"plan.train_tokens_per_s": 1e12}  # ~2 PB/s: no disk keeps up
    warned = preflight(gpu_config(tmp_path, **need), check_hosts=False, check_tokenizer=False)
    note = [n for n in warned.notes if n.startswith("extraction.output_dir=")]
    assert (
        warned.ok
        and len(note) == 1
        and "extraction.encoding=fp8_e4m3" in note[0]
        and "disk_check=warn" in note[0]
    )
    refused = preflight(
        gpu_config(tmp_path, **need, **{"training.disk_check": "refuse"}),
        check_hosts=False,
        check_tokenizer=False,
    )
    assert any(p.startswith("extraction.output_dir=") and "GB/s" in p for p in refused.problems)
    off = preflight(
        gpu_config(tmp_path, **need, **{"training.disk_check": "off"}),
        check_hosts=False,
        check_tokenizer=False,
    )
    assert off.ok and off.plan.disk_bytes_per_s is None and "disk_check=off" in off.plan.disk_probe


def test_the_probe_reads_an_existing_shard(tmp_path):
    shards = tmp_path / "shards" / "not-yet"
    shards.mkdir(parents=True)
    (shards / "shard-00000.safetensors").write_bytes(b"\0" * (8 << 20))
    r = preflight(gpu_config(tmp_path), check_hosts=False, check_tokenizer=False)
    assert (
        "shard-00000.safetensors on this machine" in r.plan.disk_probe
        and r.plan.disk_bytes_per_s > 0
    )
