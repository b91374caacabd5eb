"""Kill -9 a real `eyas run` mid-extraction, run it again: finished shards are kept, the rest done.

The first run is a subprocess in its own session (with its temporary Prefect server), killed with
SIGKILL as soon as the first shard file is published. The local target server it launched (its own
session) exits with it (eyas/server/launcher.py). The second run, same command, must discard the
partial file, serve the finished shards from Prefect's cache without rewriting them (same inode and
mtime), give back the GPU-host slot the killed run kept, extract the rest, and complete. A server
that outlives its run (one a `serve` run left up, an SGLang server) is stopped by the next run of
its config: test_a_stale_server_of_this_config_is_stopped_and_another_configs_left_alone.

Both runs talk to the test session's Prefect server (no temporary server to start per run); the
shard cache records live in the runs' own PREFECT_HOME, as they would on a worker.
"""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from eyas.extraction.shards import ShardReader, verify_shard
from eyas.net import free_port
from eyas.server.hosts import LocalHost, wait_dead
from tests.stage_config import ROOT

pytestmark = pytest.mark.slow


HOST = "resume-test"  # the run's name and host label (the GPU-host lock is the machine's)


def _command(tmp: Path, data: Path, port: int) -> list[str]:
    sets = {
        "name": HOST,
        "run_dir": tmp / "run",
        "server.host.name": HOST,
        "server.port": port,
        "server.workdir": tmp / "server",
        "server.dump_dir": tmp / "server" / "dump",
        "extraction.output_dir": tmp / "shards",
        "training.output_dir": tmp / "train",
        "data.path": data,
        "data.num_heldout": 2,
        "extraction.num_shards": 8,
        "extraction.concurrency": 2,
        "training.max_steps": 2,
        "training.batch_size": 2,
        "training.warmup_steps": 0,
        "evaluation.num_prompts": 1,
        "evaluation.max_new_tokens": 4,
        "sensor.poll_interval_s": 0.1,
        "benchmark.enabled": False,  # the serving benchmark (two more servers) is not under test
        "data.regenerate.enabled": False,
    }  # nor regeneration (tests/integration/test_flow_extract.py)
    cmd = [
        sys.executable,
        "-m",
        "eyas_prefect.flows.runtime.cli",
        "run",
        str(ROOT / "configs" / "local-tiny.yaml"),
    ]  # `eyas run`
    for k, v in sets.items():
        cmd += ["--set", f"{k}={v}"]
    return cmd


def _env(tmp: Path) -> dict:
    from prefect.settings import PREFECT_API_URL

    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    env.update(
        PREFECT_HOME=str(tmp / "prefect"),
        PREFECT_API_URL=PREFECT_API_URL.value(),
        PREFECT_SERVER_ANALYTICS_ENABLED="false",
        OMP_NUM_THREADS="1",
        TOKENIZERS_PARALLELISM="false",
    )
    return env


def test_kill_9_mid_extraction_then_rerun_keeps_finished_shards(tmp_path, prefect_harness):
    data = tmp_path / "conversations.jsonl"
    lines = (ROOT / "fixtures" / "data" / "conversations.jsonl").read_text().splitlines()[:34]
    data.write_text("\n".join(lines) + "\n")
    cmd, env, shards = _command(tmp_path, data, free_port()), _env(tmp_path), tmp_path / "shards"

    # 1. First run, killed with SIGKILL once a shard is published and while others are not.
    with open(tmp_path / "run1.log", "w") as log:
        first = subprocess.Popen(
            cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        deadline = time.monotonic() + 240
        while not list(shards.glob("shard-*.json")):
            assert first.poll() is None, (tmp_path / "run1.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "no shard within 240 s"
            time.sleep(0.02)
        time.sleep(1.0)  # let Prefect record the first shard's result (later ones may lack it)
        os.killpg(first.pid, signal.SIGKILL)
        first.wait(30)
    done = {
        p.name: (p.stat().st_ino, p.stat().st_mtime_ns)
        for p in shards.glob("shard-*.safetensors")
        if p.with_suffix(".json").exists()
    }
    assert 1 <= len(done) < 8, done
    host, pid = LocalHost(), json.loads((tmp_path / "server" / "server.pid").read_text())["pid"]
    assert wait_dead(host, pid, 15), "the killed run's local server outlived it"
    # ...but its GPU-host slot stays taken in Prefect: the second run must give it back itself.

    # 2. Same command again: completes.
    with open(tmp_path / "run2.log", "w") as log:
        second = subprocess.Popen(
            cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            second.wait(300)
        except subprocess.TimeoutExpired:
            os.killpg(second.pid, signal.SIGKILL)
            second.wait(30)
    out = (tmp_path / "run2.log").read_text()
    assert second.returncode == 0, out[-4000:]
    # the killed run's flow runs, set Crashed when this run took the output directory, and so its
    # hold on the GPU host, taken over
    assert "flow runs of a killed process, still shown Running, set Crashed" in out
    assert "took it from flow run" in out and "is Crashed" in out
    assert "slot(s) of eyas-gpu-host-" in out and "kept by a killed run" in out

    # Finished shards untouched: served from Prefect's cache, or (published but killed before
    # Prefect recorded the result) found intact on disk; never rewritten. The rest complete and
    # valid.
    cached = 0
    for name, ident in done.items():
        p = shards / name
        assert (p.stat().st_ino, p.stat().st_mtime_ns) == ident, f"{name} was rewritten"
        hit = f"extract-{p.stem}-of-00008@{HOST}' - Finished in state Cached" in out
        assert hit or f"{p.stem}: intact on disk, reused" in out, name
        cached += hit
    assert cached >= 1, "no shard came from Prefect's cache"
    files = sorted(shards.glob("shard-*.safetensors"))
    assert len(files) == 8 and all(verify_shard(p) for p in files)
    assert not [p.name for p in shards.iterdir() if p.name.endswith(".partial")]
    # dataset.json: the whole extraction, with provenance in both layer conventions.
    ds = json.loads((shards / "dataset.json").read_text())
    assert ds["num_shards"] == 8 and [s["file"] for s in ds["shards"]] == [p.name for p in files]
    assert ds["num_tokens"] == sum(ShardReader(p).num_tokens for p in files)
    assert ds["layer_ids_capture_before"] == [2, 4, 5] and ds["layer_ids_output_of"] == [1, 3, 4]
    assert ds["last_hidden_norm"] == "post" and ds["target_revision"] == "fixture-v1"
    assert len(ds["tokenizer_sha256"]) == 64 and len(ds["chat_template_sha256"]) == 64
    assert ds["eyas_version"] and ds["data"]["stats"]["sequences"] == 32

    # Progress: the same figures in the task log and in the run's artifacts.
    assert (
        f"extraction: 8/8 shards ({len(done)} reused)" in out
        and "tok/s" in out
        and "GB written" in out
    )
    progress, table = _artifacts(f"extract-{HOST}"), _artifacts(f"extract-shards-{HOST}")
    assert (
        progress.type == "progress"
        and progress.data == 100.0
        and "8/8 shards" in progress.description
    )
    assert table.type == "table" and len(json.loads(table.data)) == 8
    assert {r["status"] for r in json.loads(table.data)} == {"done", "reused"}


def _artifacts(key: str):
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey

    with get_client(sync_client=True) as client:
        found = client.read_artifacts(
            artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=[key]))
        )
    assert found, f"no artifact {key}"
    return max(found, key=lambda a: a.updated)


def test_output_lock_is_exclusive_and_dies_with_its_holder(tmp_path):
    from eyas.extraction.locks import (
        OutputBusy,
        discard_partials,
        lock_output_dir,
        unlock_output_dir,
    )

    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time; from eyas.extraction.locks import lock_output_dir; "
            f"lock_output_dir({str(tmp_path)!r}); print('held', flush=True); time.sleep(60)",
        ],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(OutputBusy, match=rf"in use by another eyas run \(pid {holder.pid}"):
            lock_output_dir(tmp_path)
    finally:
        holder.kill()
        holder.wait(10)
    (tmp_path / ".shard-00002.safetensors.partial").write_bytes(b"x")
    (tmp_path / "shard-00001.json").write_text("{}")
    lock_output_dir(tmp_path)  # the killed holder's lock went with it
    assert discard_partials(tmp_path) == [".shard-00002.safetensors.partial"]
    assert (tmp_path / "shard-00001.json").exists()
    unlock_output_dir(tmp_path)


def test_a_stale_server_of_this_config_is_stopped_and_another_configs_left_alone(
    tmp_path, random_target
):
    """A server that outlives the run that launched it (launched to stay up, as a `serve` run's, or
    an SGLang server, which does not watch its launcher): the next run of the same config, holding
    the output directory's lock, stops it; a server of another config (another command line) is
    left."""
    from eyas.extraction.locks import lock_output_dir, reclaim_stale_server, unlock_output_dir
    from eyas.server.launch import capture_launch, start_server, stop_server
    from tests.stage_config import stage_config

    host, cfg = LocalHost(), stage_config(tmp_path, random_target)
    handle = start_server(host, capture_launch(cfg), leave_up=True)
    try:
        other = cfg.model_copy(
            update={"server": cfg.server.model_copy(update={"chunked_prefill_size": 32})}
        )
        lock_output_dir(cfg.extraction.output_dir)
        left = reclaim_stale_server(host, other)
        assert left["outcome"] == "left alone: not this config's server" and host.is_alive(
            handle.pid
        )
        stopped = reclaim_stale_server(host, cfg)
        assert stopped["reason"] == "stale server of a killed run of this config"
        assert wait_dead(host, handle.pid, 10)
    finally:
        unlock_output_dir(cfg.extraction.output_dir)
        stop_server(host, capture_launch(cfg), handle)
