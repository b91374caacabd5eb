"""The `sglang` backend against real SGLang 0.5.23 serving a tiny Llama on this machine's CPU.

Runs where a real SGLang 0.5.23 CPU environment is installed (tests/sglang_cpu.py says where and
how; .ci/run installs one when ../shared/sglang-cpu/ is there); skips everywhere else, saying why.
What it exercises is eyas's own path, unchanged: the patch stage (hook-only capture:
eyas_sglang_hook.py and eyas_dump.py into the server python's site-packages, no SGLang file
changed), launch_command (--forward-hooks, the capture-only flags), the readiness sensor reading
SGLang's own log (loading bar, ready line), the collector extracting shards from the hook's dump
records, and shard validation. The captured states are checked against transformers' hidden
states on the same weights, so a layer off by one fails.

0.5.23's CPU kernel is older than its attention code, so attention runs on `torch_native`, where
EAGLE-3 decoding and MLA do not run: the target here is a Llama. The DeepSeek-V3 target, EAGLE-3
serving and the 0.5.18 patch set: test_sglang_cpu_dsv3.py.

EYAS_SGLANG_CPU_REPORT=path.json writes the figures (load, readiness, extraction) for bench/results.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path

import pytest

from tests.sglang_cpu import (
    capture_stand,
    compare_with_transformers,
    cpu_server,
    extract,
    sglang_cpu_python,
    subset_of_conversations,
)

pytestmark = pytest.mark.sglang_cpu

VERSION = "0.5.23"
REPORT_ENV = "EYAS_SGLANG_CPU_REPORT"
CAPTURE = [2, 4, 5]  # capture-before ids of the 8-layer tiny Llama (local-tiny's)


@pytest.fixture(scope="module")
def figures():
    out = {"sglang": VERSION, "started": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    yield out
    path = os.environ.get(REPORT_ENV)
    if path:
        Path(path).write_text(json.dumps(out, indent=1, default=str) + "\n")


@pytest.fixture(scope="module")
def real_sglang(tmp_path_factory, figures):
    """The tiny Llama served by real SGLang, launched and sensed by eyas."""
    python = sglang_cpu_python(VERSION)
    from tests.stage_config import stage_config
    from tests.tiny_llama import write_tiny_llama

    tmp = tmp_path_factory.mktemp("sglang-cpu")
    target = write_tiny_llama(tmp / "tiny-llama")
    overrides = {
        **cpu_server(VERSION, python),
        "server.chunked_prefill_size": 64,
        "server.max_running_requests": 8,
        "sensor.poll_interval_s": 0.5,
        "sensor.stall_timeout_s": 300,
        "sensor.deadline_s": 900,
        "data.path": str(subset_of_conversations(tmp / "conversations.jsonl", 14)),
        "data.num_heldout": 2,
        "data.regenerate.enabled": False,
        "extraction.num_shards": 3,
        "extraction.concurrency": 4,
        "extraction.keep_free_gb": 0.1,
        "server.capture": "forward_hook",  # the default, said explicitly: no SGLang file changes
    }
    cfg = stage_config(tmp, target, **overrides)
    assert cfg.target.capture_ids() == CAPTURE
    with capture_stand(cfg, figures) as stand:
        yield cfg, *stand


def test_patch_stage_installs_the_hook_and_changes_no_sglang_file(real_sglang):
    """Hook-only capture of a Llama target: the hook and the dump writer go into site-packages;
    SGLang's own model files stay as the wheel has them."""
    from eyas.server.patch_sets import load_patch_set

    cfg, _, _, patch, _, _ = real_sglang
    assert patch.status in ("patched", "already patched"), patch
    assert patch.sglang_version == VERSION
    site = Path(patch.site_packages)
    assert (site / "eyas_sglang_hook.py").is_file() and (site / "eyas_dump.py").is_file()
    for f in load_patch_set(VERSION).files:  # deepseek_v2.py: the wheel's bytes
        assert hashlib.sha256((site / f.path).read_bytes()).hexdigest() == f.original_sha256, f.path


def test_ready_is_read_from_sglangs_own_log(real_sglang):
    """The sensor saw SGLang's loading bar over every safetensors shard and its ready line."""
    from eyas.server.readiness import READY_LINE

    cfg, handle, report, _, progress, _ = real_sglang
    shards = len(list(Path(cfg.target.checkpoint).glob("*.safetensors")))
    assert report.shards_total == shards, (report, shards)
    assert progress and progress[-1].done == shards
    assert progress[-1].desc in (
        "Multi-thread loading shards",
        "Loading safetensors checkpoint shards",
    )
    assert READY_LINE in Path(handle.log_path).read_text(errors="replace")
    assert "--forward-hooks" in handle.command and "eyas_sglang_hook:make_hook" in handle.command
    assert "--enable-return-aux-hidden-states" in handle.command  # 0.5.23's capture-only mode


def test_extracted_shards_hold_the_targets_hidden_states(real_sglang, figures):
    """prepare -> run_shard for every plan through the real server's hook -> valid shards whose
    hidden states are transformers' on the same weights (the configured capture-before layers)."""
    from eyas.extraction.dataset import dataset_path

    cfg, _, _, patch, _, prepared = real_sglang
    assert len(prepared.plans) == 3
    manifests = extract(cfg, patch, prepared, figures)
    compare_with_transformers(cfg, manifests, figures, samples_per_shard=1)
    assert dataset_path(cfg.extraction.output_dir).exists()
    assert all(m.hidden_size == 256 for m in manifests)
