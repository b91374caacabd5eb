"""The serving benchmark: config, launch commands, and the subflow against real local servers."""

import json
from pathlib import Path

import pytest
import torch

from eyas.config import ConfigError, load_config
from eyas.server.launch import launch_command
from eyas.evaluation.serve_bench import markdown, server_config
from tests.stage_config import ROOT, stage_config


def test_benchmark_section_defaults_and_checks_the_chain():
    cfg = load_config(ROOT / "configs" / "local-tiny.yaml")
    b = cfg.benchmark
    assert (b.speculative_num_steps, b.speculative_eagle_topk, b.speculative_num_draft_tokens) == (3, 1, 4)
    with pytest.raises(ConfigError, match="speculative_num_draft_tokens"):
        load_config(ROOT / "configs" / "local-tiny.yaml", {"benchmark.speculative_num_draft_tokens": 8})
    seven = load_config(ROOT / "configs" / "local-tiny.yaml",
                        {"benchmark.speculative_num_steps": 7, "benchmark.speculative_num_draft_tokens": 8})
    assert seven.benchmark.speculative_num_draft_tokens == 8


@pytest.mark.parametrize("backend", ["local", "sglang"])
def test_bench_launches_differ_only_in_the_speculative_flags(tmp_path, backend):
    cfg = stage_config(tmp_path, ROOT / "fixtures" / "tiny-target", **{"server.backend": backend,
                                                                        "server.launch_args": ["--x", "1"]})
    plain = launch_command(server_config(cfg, "plain", None))
    spec = launch_command(server_config(cfg, "speculative", "/d/drafter"))
    for cmd in (plain, spec):  # a serving launch: no hidden-state capture, no dump hook
        assert "--enable-return-aux-hidden-states" not in cmd and "--forward-hooks" not in cmd
        assert "--x 1" in cmd and "--disable-radix-cache" in cmd
    assert spec.startswith(plain)
    assert spec[len(plain):].split() == [
        "--speculative-algorithm", "EAGLE3", "--speculative-draft-model-path", "/d/drafter",
        "--speculative-num-steps", "3", "--speculative-eagle-topk", "1", "--speculative-num-draft-tokens", "4"]
    assert server_config(cfg, "plain", None).server.workdir != cfg.server.workdir
    assert "--enable-return-aux-hidden-states" in launch_command(cfg)  # extraction is unchanged


@pytest.mark.parametrize("interleave", [True, False])
def test_subflow_measures_both_servers_on_the_same_prompts(prefect_harness, exported_drafter, tmp_path,
                                                           interleave):
    from flows.serve_bench import serve_bench_flow

    target, drafter = exported_drafter
    cfg = stage_config(tmp_path, target, **{"benchmark.interleave": interleave,
        "benchmark.num_prompts": 2, "benchmark.max_new_tokens": 12, "benchmark.num_warmup": 1,
        "benchmark.num_repeats": 2, "benchmark.concurrency": 2})
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(3, 512, (n,), generator=g).tolist() for n in (6, 20, 9)]
    result = serve_bench_flow(cfg, drafter_dir=str(drafter), prompts=prompts)

    assert result["identical_outputs"] is True  # greedy: the drafter changes no token
    plain, spec = result["plain"], result["speculative"]
    assert plain["acceptance_length"] is None and 1.0 <= spec["acceptance_length"] <= 4.0
    assert spec["server_avg_spec_accept_length"] >= 1.0  # includes the warm-up, so not compared exactly
    for side in (plain, spec):
        assert len(side["single_stream_runs"]) == 2 and side["single_stream_tokens_per_s"] > 0
        assert side["concurrent_tokens_per_s"] > 0 and side["ttft_s"] > 0
    assert "--speculative-draft-model-path" in spec["command"]
    assert "--speculative-draft-model-path" not in plain["command"]
    r = result["speedup"]
    assert r["single_stream_tokens_per_s"] == pytest.approx(
        spec["single_stream_tokens_per_s"] / plain["single_stream_tokens_per_s"], abs=1e-3)
    assert result["settings"]["num_prompts"] == 2 and result["machine"]["cpus"]
    saved = json.loads((Path(cfg.run_dir) / "serve_bench.json").read_text())
    assert saved["speedup"] == r
    assert "Single-stream speed-up" in markdown(result)
    for label in ("plain", "speculative"):  # both stopped (the pid file goes with the server)
        assert not (Path(cfg.server.workdir) / f"bench-{label}" / "server.pid").exists()
    ports = {side["command"].split("--port ")[1].split()[0] for side in (plain, spec)}
    assert len(ports) == (2 if interleave else 1)


def test_disabled_benchmark_launches_nothing(prefect_harness, tmp_path):
    from flows.serve_bench import serve_bench_flow

    cfg = stage_config(tmp_path, ROOT / "fixtures" / "tiny-target", **{"benchmark.enabled": False})
    assert serve_bench_flow(cfg, drafter_dir=str(tmp_path / "missing")) is None
    assert not (tmp_path / "server").exists()


def test_a_rerun_reports_the_cached_measurement_unless_refreshed(prefect_harness, exported_drafter, tmp_path):
    from flows.serve_bench import serve_bench_flow

    target, drafter = exported_drafter
    cfg = stage_config(tmp_path, target, **{"benchmark.num_prompts": 1, "benchmark.max_new_tokens": 6,
                                            "benchmark.num_warmup": 0, "benchmark.num_repeats": 1,
                                            "benchmark.concurrency": 1, "benchmark.interleave": False})
    prompts, log = [[5, 6, 7, 8], [9, 10, 11]], Path(cfg.server.workdir) / "bench-plain" / "server.log"

    def launches(run) -> tuple[dict, bool]:
        before = log.stat().st_mtime_ns if log.exists() else None
        result = run()
        return result, log.stat().st_mtime_ns != before

    first, launched = launches(lambda: serve_bench_flow(cfg, drafter_dir=str(drafter), prompts=prompts))
    assert launched
    again, launched = launches(lambda: serve_bench_flow(cfg, drafter_dir=str(drafter), prompts=prompts))
    assert again == first and not launched  # the same inputs: the cached figures, no server
    _, launched = launches(lambda: serve_bench_flow(cfg, drafter_dir=str(drafter), prompts=prompts[:1]))
    assert launched  # other prompts: measured
    refresh = cfg.model_copy(update={"refresh": ["serve_bench"]})
    refreshed, launched = launches(lambda: serve_bench_flow(refresh, drafter_dir=str(drafter), prompts=prompts))
    assert launched and refreshed["settings"] == first["settings"]


def test_the_drafter_is_uploaded_once_to_an_ssh_server_host(sshd, exported_drafter, tmp_path):
    from eyas.server.hosts import SSHHost
    from eyas.evaluation.serve_bench import DRAFTER_FILES, stage_drafter
    from tests.integration.test_hosts import ssh_config

    _, drafter = exported_drafter
    host_cfg = ssh_config(sshd)
    cfg = stage_config(tmp_path, ROOT / "fixtures" / "tiny-target", **{"server.host": host_cfg.model_dump()})
    local = stage_config(tmp_path, ROOT / "fixtures" / "tiny-target")
    assert stage_drafter(None, local, drafter) == drafter  # a local server reads it where it is
    host = SSHHost(host_cfg)
    try:
        remote = stage_drafter(host, cfg, drafter)
        assert remote.parent == tmp_path / "server" / "drafters" and remote != drafter
        for name in DRAFTER_FILES:
            assert (remote / name).read_bytes() == (drafter / name).read_bytes()
        stamp = (remote / "model.safetensors").stat().st_mtime_ns
        assert stage_drafter(host, cfg, drafter) == remote  # named by its digest: not sent again
        assert (remote / "model.safetensors").stat().st_mtime_ns == stamp
        assert not list(remote.parent.glob(".*partial"))
    finally:
        host.close()
