"""The `sglang` backend against real SGLang 0.5.23 serving a tiny Llama on this machine's CPU.

Runs only where a real SGLang CPU environment is given (built by scripts/sglang-cpu/build.sh):

    EYAS_SGLANG_CPU_PYTHON=/work/sglang-cpu/.venv/bin/python \
        .venv/bin/python -m pytest -q -n0 -m sglang_cpu tests/integration/test_sglang_cpu.py

Everywhere else (CI) every test skips at once, saying why. What it exercises is eyas's own path,
unchanged: the patch stage (hook-only capture: eyas_sglang_hook.py and eyas_dump.py into the
server python's site-packages, no SGLang file changed), launch_command (--forward-hooks, capture
flags), the readiness sensor reading SGLang's own log (loading bar, ready line), the collector
extracting shards from the hook's dump records, and shard validation. The captured states are
checked against transformers' hidden states on the same weights, so a layer off by one fails.

The CPU server's own flags come through the config (server.launch_args, server.env) as an operator
would give them (../shared/docs/sglang-cpu.md): the CPU kernels built from source are older than
0.5.23, so attention runs on `torch_native`; EAGLE3 decoding and MLA do not run there, which is why
the target is a Llama.

EYAS_SGLANG_CPU_REPORT=path.json writes the figures (load, readiness, extraction) for bench/results.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import time
from pathlib import Path

import pytest

from eyas.server.hosts import LocalHost

pytestmark = pytest.mark.sglang_cpu

ENV = "EYAS_SGLANG_CPU_PYTHON"
REPORT_ENV = "EYAS_SGLANG_CPU_REPORT"
VERSION = "0.5.23"
ROOT = Path(__file__).resolve().parents[2]
CAPTURE = [2, 4, 5]  # capture-before ids of the 8-layer tiny Llama (local-tiny's)
NUM_CONVERSATIONS = 14  # 12 trained, 2 held out: a few shards in well under a minute
CPU_LAUNCH_ARGS = ["--device", "cpu", "--disable-overlap-schedule", "--attention-backend", "torch_native",
                   "--mem-fraction-static", "0.05", "--max-total-tokens", "4096"]
CPU_ENV = {"SGLANG_USE_CPU_ENGINE": "1"}
_PROBE = ("import importlib.metadata as m, sgl_kernel, sglang, torch; "
          "print(m.version('sglang')); print(hasattr(torch.ops.sgl_kernel, 'extend_attention_cpu'))")


def _cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    return {f for line in text.splitlines() if line.startswith("flags") for f in line.split(":", 1)[1].split()}


def sglang_cpu_python() -> str:
    """The SGLang CPU environment's python, or a skip naming what is missing."""
    python = os.environ.get(ENV)
    if not python:
        pytest.skip(f"{ENV} is not set: no real SGLang {VERSION} CPU environment here "
                    f"(scripts/sglang-cpu/build.sh builds one)")
    missing = {"amx_bf16", "amx_tile", "avx512_bf16"} - _cpu_flags()
    if missing:
        pytest.skip(f"this CPU lacks {sorted(missing)}, which SGLang's CPU kernels are built for")
    try:
        r = subprocess.run([python, "-c", _PROBE], capture_output=True, text=True, timeout=300,
                           env={**os.environ, **CPU_ENV}, check=False)
    except (OSError, subprocess.TimeoutExpired) as e:
        pytest.skip(f"{ENV}={python} cannot be run: {type(e).__name__}: {e}")
    out = r.stdout.split()
    if r.returncode != 0 or len(out) < 2:
        pytest.skip(f"{ENV}={python} cannot import sglang and its CPU kernel sgl_kernel "
                    f"(exit {r.returncode}): {(r.stderr or r.stdout).strip()[-400:]}")
    if out[0] != VERSION:
        pytest.skip(f"{ENV}={python} has sglang {out[0]}; this tier is for {VERSION}")
    if out[1] != "True":
        pytest.skip(f"{ENV}={python}: sgl_kernel has no CPU ops (a CUDA build of the kernel?)")
    return python


@pytest.fixture(scope="module")
def figures():
    out = {"sglang": VERSION, "started": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    yield out
    path = os.environ.get(REPORT_ENV)
    if path:
        Path(path).write_text(json.dumps(out, indent=1, default=str) + "\n")


@pytest.fixture(scope="module")
def real_sglang(tmp_path_factory, figures):
    """The tiny Llama served by real SGLang, launched and sensed by eyas: (cfg, handle, report, patch)."""
    python = sglang_cpu_python()
    from eyas.extraction import stage
    from eyas.server import readiness
    from eyas.server.launch import start_server, stop_server
    from eyas.server.sglang_patch import ensure_patched, reverse_patch
    from tests.stage_config import stage_config
    from tests.tiny_llama import write_tiny_llama

    tmp = tmp_path_factory.mktemp("sglang-cpu")
    target = write_tiny_llama(tmp / "tiny-llama")
    data = tmp / "conversations.jsonl"
    lines = (ROOT / "fixtures" / "data" / "conversations.jsonl").read_text().splitlines()
    data.write_text("\n".join(lines[:NUM_CONVERSATIONS]) + "\n")
    overrides = {
        "server.backend": "sglang", "server.python": python, "server.launch_args": CPU_LAUNCH_ARGS,
        "server.env": CPU_ENV, "server.chunked_prefill_size": 64, "server.max_running_requests": 8,
        "sensor.poll_interval_s": 0.5, "sensor.stall_timeout_s": 300, "sensor.deadline_s": 900,
        "data.path": str(data), "data.num_heldout": 2, "data.regenerate.enabled": False,
        "extraction.num_shards": 3, "extraction.concurrency": 4, "extraction.keep_free_gb": 0.1,
        "server.capture": "forward_hook",  # the default, said explicitly: no SGLang file changes
    }
    cfg = stage_config(tmp, target, **overrides)
    host = LocalHost()
    t0 = time.monotonic()
    patch = ensure_patched(host, cfg)
    figures["patch"] = {"status": patch.status, "actions": patch.actions, "seconds": time.monotonic() - t0}
    progress = []
    handle = None
    try:
        # The pipeline's order: prepare-data takes the output dir (and would stop a server recorded
        # for this config as a killed run's), then the server is launched.
        with stage.ExtractionContext() as ctx:
            prepared = stage.prepare(ctx, cfg, log=lambda fmt, *a: print(fmt % a))
        t0 = time.monotonic()
        handle = start_server(host, cfg)
        figures["launch_command"] = handle.command
        report = readiness.wait_until_ready(
            host, log_path=handle.log_path, pid=handle.pid, url=handle.url, start_offset=handle.log_offset,
            poll_interval_s=cfg.sensor.poll_interval_s, stall_timeout_s=cfg.sensor.stall_timeout_s,
            deadline_s=cfg.sensor.deadline_s, http_timeout_s=30, on_progress=progress.append)
        figures["ready_s"] = round(time.monotonic() - t0, 1)
        figures["shards_total"] = report.shards_total
        yield cfg, handle, report, patch, progress, prepared
    finally:
        if handle is not None:
            figures["server_log_tail"] = Path(handle.log_path).read_text(errors="replace")[-3000:]
            stop_server(host, cfg, handle)
        figures["reverse"] = reverse_patch(host, cfg).status


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
    assert progress[-1].desc in ("Multi-thread loading shards", "Loading safetensors checkpoint shards")
    log = Path(handle.log_path).read_text(errors="replace")
    assert READY_LINE in log
    assert "--forward-hooks" in handle.command and "eyas_sglang_hook:make_hook" in handle.command


def test_extracted_shards_hold_the_targets_hidden_states(real_sglang, figures):
    """prepare -> run_shard for every plan through the real server's hook -> valid shards whose
    hidden states are transformers' on the same weights (the configured capture-before layers)."""
    import torch

    from eyas.extraction import stage
    from eyas.extraction.dataset import dataset_path
    from eyas.extraction.extract import shard_path
    from eyas.extraction.shards import ShardReader, verify_shard
    from tests.tiny_llama import reference_hidden_states

    cfg, _, _, patch, _, prepared = real_sglang
    log = lambda fmt, *a: print(fmt % a)  # noqa: E731
    assert len(prepared.plans) == 3
    t0 = time.monotonic()
    with stage.ExtractionContext() as ctx:
        manifests = [stage.run_shard(ctx, cfg, plan, patch.patch_version, log=log) for plan in prepared.plans]
    seconds = time.monotonic() - t0
    tokens = sum(m.num_tokens for m in manifests)
    figures["extraction"] = {"shards": len(manifests), "samples": sum(m.num_samples for m in manifests),
                             "tokens": tokens, "seconds": round(seconds, 2),
                             "tokens_per_s": round(tokens / seconds, 1),
                             "bytes": sum(m.bytes for m in manifests)}
    assert dataset_path(cfg.extraction.output_dir).exists()

    worst = {"aux": 0.0, "last": 0.0}
    for plan, manifest in zip(prepared.plans, manifests):
        path = shard_path(cfg.extraction.output_dir, plan)
        assert verify_shard(path, full=True)["num_tokens"] == manifest.num_tokens
        reader = ShardReader(path)
        assert reader.num_aux == len(CAPTURE) and reader.hidden_size == 256
        assert reader.meta["capture_ids"] == CAPTURE
        for i in range(min(2, len(reader))):
            sample = reader.sample(i)
            aux, last = reference_hidden_states(cfg.target.checkpoint, sample.input_ids.tolist(), CAPTURE)
            for name, got, want in (("aux", sample.aux_hidden_states.float(), aux),
                                    ("last", sample.last_hidden_state.float(), last)):
                assert got.shape == want.shape, (name, got.shape, want.shape)
                err = float((got - want).norm() / want.norm())
                worst[name] = max(worst[name], err)
                if name == "aux" and err > 0.05:
                    raise AssertionError(f"{path.name} sample {i}: captured states are not HF hidden_states"
                                         f"{CAPTURE} (relative error {err:.3f}); they match "
                                         f"{_which_layers(cfg.target.checkpoint, sample, reader.num_aux)}")
                assert err < 0.05, f"{path.name} sample {i} {name}: relative error {err:.4f}"
                cos = torch.nn.functional.cosine_similarity(got, want, dim=-1)
                assert float(cos.min()) > 0.99, (name, float(cos.min()))
    figures["max_relative_error"] = worst


def _which_layers(checkpoint, sample, num_aux: int) -> str:
    """For a failure message: the HF hidden_states index each captured block is closest to."""
    import torch
    import transformers

    model = transformers.LlamaForCausalLM.from_pretrained(str(checkpoint), dtype=torch.bfloat16).eval()
    with torch.no_grad():
        states = model(sample.input_ids[None], output_hidden_states=True).hidden_states
    blocks = sample.aux_hidden_states.float().chunk(num_aux, dim=-1)
    best = []
    for b in blocks:
        errs = [float((b - s[0].float()).norm() / s[0].float().norm()) for s in states]
        best.append(min(range(len(errs)), key=errs.__getitem__))
    return f"HF hidden_states{best}"
