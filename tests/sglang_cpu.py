"""Real SGLang on this machine's CPU, for the real-SGLang tier
(tests/integration/test_sglang_cpu*.py).

    python = sglang_cpu_python("0.5.18")      # the environment's python, or a skip saying why
    overrides = cpu_server("0.5.18", python)  # server.* settings that serve on this CPU

An environment per SGLang version holds sglang, its pinned torch and a CPU kernel wheel.
scripts/sglang-cpu/install.sh makes one (about 2 minutes) at ~/.cache/eyas-sglang-cpu/VERSION,
where the tier finds it (or at $EYAS_SGLANG_CPU_ENVS/VERSION); its kernel wheel comes from
scripts/sglang-cpu/build.sh, or prebuilt from ../shared/sglang-cpu/VERSION/, which .ci/run installs
from when that folder is there. Without an environment every test of the tier skips, naming these.

What runs where (../shared/docs/sglang-cpu.md): 0.5.23 serves a Llama with capture-only mode on the
torch_native attention backend; 0.5.18 serves DeepSeek-V3 (MLA, MoE) and EAGLE-3 decoding on
intel_amx, and captures through a stub draft (eyas/server/capture_draft.py).
"""

from __future__ import annotations

import functools
import os
import subprocess
import time
from contextlib import contextmanager
from pathlib import Path

import pytest

from eyas.training.gemm import cpu_flags

ROOT = Path(__file__).resolve().parents[1]
ENVS = Path(os.environ.get("EYAS_SGLANG_CPU_ENVS") or Path.home() / ".cache" / "eyas-sglang-cpu")
CPU_ENV = {"SGLANG_USE_CPU_ENGINE": "1"}
# The KV pool is the memory free after the weights load less (1 - mem-fraction-static) of what was
# free before, capped by --max-total-tokens. At 0.05 another test's model loading meanwhile left
# room for 104 tokens ("Input length (251 tokens) exceeds the maximum allowed length (98 tokens)");
# at 0.2 the cap decides, with gigabytes to spare. --sleep-on-idle: an idle scheduler otherwise
# polls for requests on a whole core (measured: 100% of one, against 1% with it), taking half of a
# 2-core machine from the tests beside it whenever the server waits.
_COMMON = [
    "--device",
    "cpu",
    "--disable-overlap-schedule",
    "--mem-fraction-static",
    "0.2",
    "--max-total-tokens",
    "4096",
    "--sleep-on-idle",
]
#: per version: the flags that serve on this CPU (0.5.23's kernel is older than its attention code,
#: so it attends on torch_native; 0.5.18 matches its kernel and runs intel_amx, the default)
LAUNCH_ARGS = {"0.5.23": [*_COMMON, "--attention-backend", "torch_native"], "0.5.18": _COMMON}
_PROBE = (
    "import importlib.metadata as m, sgl_kernel, sglang, torch; "
    "from sglang.srt.utils import cpu_has_amx_support; "
    "print(m.version('sglang')); print(hasattr(torch.ops.sgl_kernel, 'extend_attention_cpu')); "
    "print(cpu_has_amx_support())"
)
#: the versions that serve on SGLang's CPU kernels (intel_amx), which SGLang takes only where it
#: finds AMX; scripts/sglang-cpu/patches/0.5.18/intel_amx_on_avx512_bf16.patch lets it take them on
#: AVX512-BF16 as well, where they run (an AMD EPYC Zen 5 passes the whole 0.5.18 module)
ON_CPU_KERNELS = {"0.5.18"}


@functools.cache
def _check(version: str) -> tuple[str | None, str]:
    """(python, "") for a working environment of `version`, else (None, why not)."""
    python = ENVS / version / "bin" / "python"
    how = (
        f"scripts/sglang-cpu/install.sh {version} KERNEL_WHEEL makes one (the wheel: "
        f"scripts/sglang-cpu/build.sh, or ../shared/sglang-cpu/{version}/)"
    )
    if not (ENVS / version / "ready.json").is_file() or not python.exists():
        return None, f"no real SGLang {version} CPU environment at {ENVS / version}: {how}"
    if "avx512_bf16" not in cpu_flags():
        return None, "this CPU lacks avx512_bf16, which SGLang's CPU kernel wheels are built for"
    try:
        r = subprocess.run(
            [str(python), "-c", _PROBE],
            capture_output=True,
            text=True,
            timeout=300,
            env={**os.environ, **CPU_ENV},
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired) as e:
        return None, f"{python} cannot be run: {type(e).__name__}: {e}"
    out = r.stdout.split()
    if r.returncode != 0 or len(out) < 3:
        return None, (
            f"{python} cannot import sglang and its CPU kernel (exit {r.returncode}): "
            f"{(r.stderr or r.stdout).strip()[-400:]}; {how}"
        )
    if out[0] != version:
        return None, f"{python} has sglang {out[0]}, not {version}; {how}"
    if out[1] != "True":
        return None, f"{python}: sgl_kernel has no CPU ops (a CUDA build of the kernel?); {how}"
    if version in ON_CPU_KERNELS and out[2] != "True":
        return None, (
            f"SGLang {version} at {python} does not take its CPU kernels on this CPU (no AMX, and "
            "the environment predates scripts/sglang-cpu/patches/0.5.18/"
            "intel_amx_on_avx512_bf16.patch): it would fall back to torch_native attention, which "
            f"refuses EAGLE; {how}"
        )
    return str(python), ""


def sglang_cpu_python(version: str) -> str:
    """The python of the SGLang `version` CPU environment, or a skip naming what is missing."""
    python, why = _check(version)
    if python is None:
        pytest.skip(why)
    return python


def cpu_server(version: str, python: str) -> dict:
    """server.* overrides that launch real SGLang `version` on this CPU."""
    return {
        "server.backend": "sglang",
        "server.python": python,
        "server.launch_args": LAUNCH_ARGS[version],
        "server.env": CPU_ENV,
    }


def states_against_transformers(folder: str | Path, sample, capture_ids: list[int]) -> list[tuple]:
    """One shard sample's captured states beside transformers' on the same tokens: per state
    ("layer i" for each capture id, then "last") (name, captured, float32 forward, bf16 forward),
    each a float32 [T, H]."""
    ids, k = sample.input_ids.tolist(), len(capture_ids)
    f32 = reference_hidden_states(folder, ids, capture_ids)
    bf16 = reference_hidden_states(folder, ids, capture_ids, "bfloat16")
    got = (sample.aux_hidden_states.float(), sample.last_hidden_state.float())
    return list(
        zip(
            [f"layer {i}" for i in capture_ids] + ["last"],
            [*got[0].chunk(k, -1), got[1]],
            [*f32[0].chunk(k, -1), f32[1]],
            [*bf16[0].chunk(k, -1), bf16[1]],
        )
    )


@functools.cache
def _reference_model(folder: str, dtype_name: str):
    import torch
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(
        folder, dtype=getattr(torch, dtype_name)
    ).eval()


def reference_hidden_states(
    folder: str | Path, input_ids: list[int], capture_ids: list[int], dtype_name: str = "float32"
):
    """What SGLang should capture for `input_ids`, by transformers on the same weights: (aux [T,
    K*H] = HF hidden_states[i] for each capture-before id i, concatenated; last [T, H] = the final
    normed state), computed in `dtype_name`, returned in float32."""
    import torch

    model = _reference_model(str(folder), dtype_name)
    with torch.no_grad():
        out = model(torch.tensor([input_ids]), output_hidden_states=True)
    states = out.hidden_states  # embeddings, then each layer's output; the last is post-norm
    aux = torch.cat([states[i][0].float() for i in capture_ids], dim=-1)
    return aux, states[-1][0].float()


def which_layers(checkpoint, sample, num_aux: int) -> str:
    """For a failure message: the HF hidden_states index each captured block is closest to."""
    import torch

    model = _reference_model(str(checkpoint), "float32")
    with torch.no_grad():
        states = model(sample.input_ids[None], output_hidden_states=True).hidden_states
    blocks = sample.aux_hidden_states.float().chunk(num_aux, dim=-1)
    best = []
    for b in blocks:
        errs = [float((b - s[0].float()).norm() / s[0].float().norm()) for s in states]
        best.append(min(range(len(errs)), key=errs.__getitem__))
    return f"HF hidden_states{best}"


def subset_of_conversations(path: Path, count: int) -> Path:
    """The first `count` lines of fixtures/data/conversations.jsonl, written to `path`."""
    lines = (ROOT / "fixtures" / "data" / "conversations.jsonl").read_text().splitlines()
    path.write_text("\n".join(lines[:count]) + "\n")
    return path


@contextmanager
def capture_stand(cfg, figures: dict):
    """eyas's own path on a real SGLang capture server: the patch stage, prepare-data, the launch
    and the readiness sensor; yields (handle, ready report, patch report, progress, prepared); stops
    the server and reverses the patch on the way out, noting figures."""
    from eyas.extraction import stage
    from eyas.server import readiness
    from eyas.server.hosts import LocalHost
    from eyas.server.launch import capture_launch, start_server, stop_server
    from eyas.server.sglang_patch import ensure_patched, reverse_patch

    host = LocalHost()
    t0 = time.monotonic()
    patch = ensure_patched(host, cfg)
    figures["patch"] = {
        "status": patch.status,
        "actions": patch.actions,
        "seconds": round(time.monotonic() - t0, 2),
    }
    progress, handle = [], None
    try:
        # The pipeline's order: prepare-data takes the output dir (and would stop a server recorded
        # for this config as a killed run's), then the server is launched.
        with stage.ExtractionContext() as ctx:
            prepared = stage.prepare(ctx, cfg, log=lambda fmt, *a: print(fmt % a))
        t0 = time.monotonic()
        handle = start_server(host, capture_launch(cfg))
        figures["launch_command"] = handle.command
        report = readiness.wait_until_ready(
            host,
            log_path=handle.log_path,
            pid=handle.pid,
            url=handle.url,
            start_offset=handle.log_offset,
            poll_interval_s=cfg.sensor.poll_interval_s,
            stall_timeout_s=cfg.sensor.stall_timeout_s,
            deadline_s=cfg.sensor.deadline_s,
            http_timeout_s=30,
            on_progress=progress.append,
        )
        figures["ready_s"] = round(time.monotonic() - t0, 1)
        figures["shards_total"] = report.shards_total
        yield handle, report, patch, progress, prepared
    finally:
        if handle is not None:
            figures["server_log_tail"] = Path(handle.log_path).read_text(errors="replace")[-3000:]
            stop_server(host, capture_launch(cfg), handle)
        figures["reverse"] = reverse_patch(host, cfg).status


def extract(cfg, patch, prepared, figures: dict) -> list:
    """run_shard for every plan through the real server's hook: the shards' manifests."""
    from eyas.extraction import stage

    t0 = time.monotonic()
    with stage.ExtractionContext() as ctx:
        manifests = [
            stage.run_shard(ctx, cfg, plan, patch.patch_version, log=lambda f, *a: print(f % a))
            for plan in prepared.plans
        ]
    seconds = time.monotonic() - t0
    tokens = sum(m.num_tokens for m in manifests)
    figures["extraction"] = {
        "shards": len(manifests),
        "samples": sum(m.num_samples for m in manifests),
        "tokens": tokens,
        "seconds": round(seconds, 2),
        "tokens_per_s": round(tokens / seconds, 1),
        "bytes": sum(m.bytes for m in manifests),
    }
    return manifests


def compare_with_transformers(
    cfg, manifests: list, figures: dict, *, samples_per_shard: int = 2
) -> None:
    """Each shard verified, and its first samples' hidden states compared, block by block, with
    transformers' in float32 on the same weights. SGLang computes in bf16, so its error may be what
    transformers' own bf16 forward shows against float32, with a margin (1.5x, and 2% at least); a
    layer off by one is tens of percent away, and fails naming the layers the captured blocks
    match."""
    import torch

    from eyas.extraction.shards import ShardReader, verify_shard

    capture = cfg.target.capture_ids()
    names = [f"layer {i}" for i in capture] + ["last"]
    worst = {n: {"sglang": 0.0, "transformers_bf16": 0.0} for n in names}
    for manifest in manifests:
        path = Path(cfg.extraction.output_dir) / manifest.file
        assert verify_shard(path, full=True)["num_tokens"] == manifest.num_tokens
        reader = ShardReader(path)
        assert reader.num_aux == len(capture) and reader.meta["capture_ids"] == capture
        for i in range(min(samples_per_shard, len(reader))):
            sample = reader.sample(i)
            for name, g, t, b in states_against_transformers(
                cfg.target.checkpoint, sample, capture
            ):
                assert g.shape == t.shape, (name, g.shape, t.shape)
                err, ref = (float((x - t).norm() / t.norm()) for x in (g, b))
                worst[name] = {
                    "sglang": max(worst[name]["sglang"], err),
                    "transformers_bf16": max(worst[name]["transformers_bf16"], ref),
                }
                if err > max(0.02, 1.5 * ref):
                    raise AssertionError(
                        f"{path.name} sample {i} {name}: relative error {err:.4f} against "
                        f"transformers in "
                        f"float32, where its bf16 forward is {ref:.4f} off; the captured blocks "
                        f"match {which_layers(cfg.target.checkpoint, sample, reader.num_aux)}"
                    )
                # row by row too: no token may be further off than bf16 leaves the worst one
                cos = [
                    float(torch.nn.functional.cosine_similarity(x, t, dim=-1).min()) for x in (g, b)
                ]
                assert cos[0] > min(0.99, cos[1]) - 0.03, (name, cos)
    figures["max_relative_error"] = {
        n: {k: round(v, 4) for k, v in w.items()} for n, w in worst.items()
    }
