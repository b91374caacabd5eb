"""The serving benchmark: config, launch commands, and the subflow against real local servers."""

import json
from pathlib import Path

import pytest
import torch

from eyas.config import ConfigError, load_config
from eyas.evaluation.acceptance import pooled, prompt_record
from eyas.evaluation.serve_bench import (
    OutputMismatch,
    ServeBenchResult,
    benchmarks,
    chains,
    check_outputs,
    compare,
    launches,
    markdown,
    reference_config,
    reference_markdown,
    run_serve_bench,
)
from eyas.evaluation.serving import Chain, serving_launch
from eyas.server.launch import capture_launch, launch_command
from tests.stage_config import ROOT, stage_config


def test_benchmark_section_defaults_and_checks_the_chain():
    cfg = load_config(ROOT / "configs" / "local-tiny.yaml")
    b = cfg.benchmark
    assert (b.speculative_num_steps, b.speculative_eagle_topk, b.speculative_num_draft_tokens) == (
        3,
        1,
        4,
    )
    with pytest.raises(ConfigError, match="speculative_num_draft_tokens"):
        load_config(
            ROOT / "configs" / "local-tiny.yaml", {"benchmark.speculative_num_draft_tokens": 8}
        )
    seven = load_config(
        ROOT / "configs" / "local-tiny.yaml",
        {"benchmark.speculative_num_steps": 7, "benchmark.speculative_num_draft_tokens": 8},
    )
    assert seven.benchmark.speculative_num_draft_tokens == 8


@pytest.mark.parametrize("backend", ["local", "sglang"])
def test_bench_launches_differ_only_in_the_speculative_flags(tmp_path, backend):
    cfg = stage_config(
        tmp_path,
        ROOT / "fixtures" / "tiny-target",
        **{"server.backend": backend, "server.launch_args": ["--x", "1"]},
    )
    plain = launch_command(serving_launch(cfg, "plain", None))
    spec = launch_command(serving_launch(cfg, "speculative", "/d/drafter", chain=Chain.of(3)))
    for cmd in (plain, spec):  # a serving launch: no hidden-state capture, no dump hook
        assert "--enable-return-aux-hidden-states" not in cmd and "--forward-hooks" not in cmd
        assert "--x 1" in cmd and "--disable-radix-cache" in cmd
    assert spec.startswith(plain)
    assert spec[len(plain) :].split() == [
        "--speculative-algorithm",
        "EAGLE3",
        "--speculative-draft-model-path",
        "/d/drafter",
        "--speculative-num-steps",
        "3",
        "--speculative-eagle-topk",
        "1",
        "--speculative-num-draft-tokens",
        "4",
    ]
    assert serving_launch(cfg, "plain", None).server.workdir != cfg.server.workdir
    # extraction is unchanged
    assert "--enable-return-aux-hidden-states" in launch_command(capture_launch(cfg))


def test_plain_once_then_one_launch_per_chain_the_benchmarks_included():
    cfg = load_config(
        ROOT / "configs" / "local-tiny.yaml", {"evaluation.draft_steps": [3, 7]}
    )  # benchmark 3/1/4
    served, bench = chains(cfg)
    assert [c.name for c in served] == ["3/1/4", "7/1/8"] and bench == served[
        0
    ]  # one launch gives both
    assert [c.name for c in chains(load_config(ROOT / "configs" / "local-tiny.yaml"))[0]] == [
        "3/1/4"
    ]  # the default
    planned = launches(cfg, "/d")
    assert [c.server.workdir.name for c in planned] == [
        "bench-plain",
        "bench-spec-3-1-4",
        "bench-spec-7-1-8",
    ]
    assert [c.server.port - cfg.server.port for c in planned] == [
        0,
        1,
        1,
    ]  # interleaved: beside plain
    assert "--speculative-num-steps 7" in launch_command(planned[2])
    # benchmark.server_env: the serving launches' environment over server.env, not the extraction's
    env = load_config(
        ROOT / "configs" / "local-tiny.yaml",
        {
            "evaluation.draft_steps": [3, 7],
            "server.env": {"OMP_NUM_THREADS": "2", "A": "x"},
            "benchmark.server_env": {"OMP_NUM_THREADS": "1"},
        },
    )
    assert [c.server.env for c in launches(env, "/d")] == [{"OMP_NUM_THREADS": "1", "A": "x"}] * 3
    assert env.server.env["OMP_NUM_THREADS"] == "2"
    other = load_config(ROOT / "configs" / "local-tiny.yaml", {"evaluation.draft_steps": [7]})
    assert [c.name for c in chains(other)[0]] == [
        "7/1/8",
        "3/1/4",
    ]  # the benchmark's chain is added
    off = load_config(
        ROOT / "configs" / "local-tiny.yaml",
        {"evaluation.draft_steps": [3, 7], "benchmark.enabled": False},
    )
    assert chains(off) == (served, None)  # acceptance only: the evaluation's chains


def test_a_changed_greedy_output_fails_on_eyas_local_and_is_only_recorded_on_sglang(tmp_path):
    record = prompt_record(4, [1, 2], 1, reference=[1, 3])
    result = ServeBenchResult(
        acceptance_length=1.0,
        headline_chain="3/1/4",
        chains={"3/1/4": {"sets": {"heldout": pooled([record])}}},
        identical_to_target=False,
        sets={},
        plain={},
        benchmark_chain=None,
        drafter_dir="/d",
        seconds=1.0,
        settings={},
        machine={},
        identical_outputs=True,
    )
    local = stage_config(tmp_path, ROOT / "fixtures" / "tiny-target")
    with pytest.raises(OutputMismatch, match=r"3/1/4 on heldout: prompt\(s\) \[0\]"):
        check_outputs(local, result)
    sglang = stage_config(
        tmp_path, ROOT / "fixtures" / "tiny-target", **{"server.backend": "sglang"}
    )
    check_outputs(sglang, result)  # recorded in the figures, never raised


def test_a_reference_backend_serves_the_same_chains_on_eyas_and_sets_its_acceptance_beside(
    tmp_path,
):
    """benchmark.reference_backend: eyas's own server beside a real SGLang, same chains, own workdir
    and ports, none of SGLang's flags; its acceptance per chain and set beside the served one."""
    with pytest.raises(ConfigError, match="reference_backend.*server.backend sglang"):
        load_config(ROOT / "configs" / "local-tiny.yaml", {"benchmark.reference_backend": "local"})
    cfg = load_config(ROOT / "configs" / "sglang-cpu.yaml")
    assert cfg.benchmark.reference_backend == "local"
    planned = launches(cfg, "/d")
    assert [c.server.backend for c in planned] == [
        "sglang",
        "sglang",
        "local",
        "local",
    ]  # the stop hook stops all
    ref_plain, ref_spec = planned[2:]
    assert ref_plain.server.workdir == cfg.server.workdir / "reference" / "bench-plain"
    assert {ref_plain.server.port, ref_spec.server.port} == {cfg.server.port + 2}
    command = launch_command(ref_spec)
    assert (
        " -m eyas serve-local " in command
        and "--device" not in command
        and "--speculative-num-steps 3" in command
    )
    assert ref_spec.server.env == {} and not reference_config(cfg).benchmark.enabled

    def result(per_prompt: list[tuple[int, int]]) -> ServeBenchResult:
        sets = {
            "heldout": pooled(
                [prompt_record(4, [0] * n, v, reference=[0] * n) for n, v in per_prompt]
            )
        }
        return ServeBenchResult(
            acceptance_length=sets["heldout"]["acceptance_length"],
            headline_chain="3/1/4",
            chains={"3/1/4": {"sets": sets}},
            identical_to_target=True,
            sets={},
            plain={},
            benchmark_chain=None,
            drafter_dir="/d",
            seconds=2.0,
            settings={"backend": "local"},
            machine={},
        )

    served, ref = result([(20, 10), (10, 5)]), result([(21, 10), (10, 5)])  # 2.0 and 31/15
    figures = compare(served, ref)
    x = figures["chains"]["3/1/4"]["heldout"]
    assert (x["served_acceptance_length"], x["acceptance_length"]) == (2.0, 31 / 15)
    assert (
        x["relative_difference"] == round(31 / 30 - 1, 4) == figures["largest_relative_difference"]
    )
    assert x["per_prompt"] == [2.1, 2.0] and figures["backend"] == "local"
    assert "| 3/1/4 | heldout | 2.000 | 2.067 | +3.3% |" in reference_markdown(figures)


@pytest.mark.parametrize(
    "interleave, concurrent",
    [(True, False), (True, True), (False, False)],
    ids=["alternating", "concurrent", "one-at-a-time"],
)
def test_subflow_measures_both_servers_on_the_same_prompts(
    prefect_harness, exported_drafter, tmp_path, interleave, concurrent
):
    from eyas_prefect.flows.serve_bench import serve_bench_flow

    target, drafter = exported_drafter
    cfg = stage_config(
        tmp_path,
        target,
        **{
            "benchmark.interleave": interleave,
            "benchmark.concurrent": concurrent,
            "benchmark.server_env": {"EYAS_BENCH_MARK": "served"},
            "benchmark.num_prompts": 2,
            "benchmark.max_new_tokens": 12,
            "benchmark.num_warmup": 1,
            "benchmark.num_repeats": 2,
            "benchmark.concurrency": 2,
            "benchmark.suites": [],
            "evaluation.draft_steps": [3],
            "evaluation.max_new_tokens": 10,
        },
    )
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(3, 512, (n,), generator=g).tolist() for n in (6, 20, 9)]
    result = serve_bench_flow(cfg, drafter_dir=str(drafter), prompts=prompts)

    assert result.identical_outputs is True  # greedy: the drafter changes no token
    plain, spec = result.plain, result.speculative
    assert plain["acceptance_length"] is None and 1.0 <= spec["acceptance_length"] <= 4.0
    assert (
        spec["server_avg_spec_accept_length"] >= 1.0
    )  # includes the warm-up, so not compared exactly
    for side in (plain, spec):
        assert len(side["single_stream_runs"]) == 2 and side["single_stream_tokens_per_s"] > 0
        assert side["concurrent_tokens_per_s"] > 0 and side["ttft_s"] > 0
    assert "--speculative-draft-model-path" in spec["command"]
    assert "--speculative-draft-model-path" not in plain["command"]
    r = result.speedup
    assert r["single_stream_tokens_per_s"] == pytest.approx(
        spec["single_stream_tokens_per_s"] / plain["single_stream_tokens_per_s"], abs=1e-3
    )
    assert result.settings["num_prompts"] == 2 and result.machine["cpus"]
    # acceptance: the held-out prompts (all 3, evaluation.num_prompts 32) on the one chain
    held = result.chains["3/1/4"]["sets"]["heldout"]
    assert result.benchmark_chain == result.headline_chain == "3/1/4"
    assert (
        held["num_prompts"] == 3
        and held["identical_to_target"] is True
        and result.identical_to_target
    )
    assert result.acceptance_length == held["acceptance_length"] >= 1.0 and held["speedup"] > 0
    assert result.chains["3/1/4"]["command"] == spec["command"]  # one launch gave both
    saved = json.loads((Path(cfg.run_dir) / "serve_bench.json").read_text())
    assert saved["speedup"] == r
    assert "Single-stream speed-up" in markdown(result) and "| heldout |" in markdown(result)
    for label in ("plain", "spec-3-1-4"):  # both stopped (the pid file goes with the server)
        assert not (Path(cfg.server.workdir) / f"bench-{label}" / "server.pid").exists()
    ports = {side["command"].split("--port ")[1].split()[0] for side in (plain, spec)}
    assert len(ports) == (2 if interleave else 1)
    assert result.settings["concurrent"] is concurrent
    for side in (plain, spec, result.chains["3/1/4"]):
        assert side["launched_at"] < side["ready_at"]
    # concurrent: both servers launched together; else the chain's once the plain one is ready (and
    # warm)
    assert (spec["launched_at"] < plain["ready_at"]) is concurrent
    assert result.settings["server_env"] == {
        **cfg.server.env,
        "EYAS_BENCH_MARK": "served",
    }  # as launched
    # the speed passes phase by phase: 2 repeats of single stream, concurrent, TTFT on each server
    windows = [plain["phase_windows"], spec["phase_windows"]]
    assert [[w[0] for w in side] for side in windows] == [
        ["single_stream", "concurrent", "ttft"] * 2
    ] * 2
    if concurrent:  # each phase starts on both servers once both have ended the phase before
        for i in range(1, 6):
            ended = max(side[i - 1][2] for side in windows)
            assert all(side[i][1] >= ended for side in windows), (i, windows)
    elif interleave:  # alternating: the plain server's whole pass, then the chain's
        assert windows[0][2][2] <= windows[1][0][1]


def test_served_acceptance_equals_in_process_evaluation_per_chain_and_prompt(
    exported_drafter, tmp_path
):
    """The strongest check: eyas-local's meta_info counters give, per chain and per prompt, exactly
    what in-process evaluation computes on the same prompts (greedy, the same drafter, the same
    target)."""
    from eyas.config import EvaluationConfig
    from eyas.evaluation.evaluate import evaluate_acceptance
    from eyas.report import served_evaluation
    from tests.helpers_training import CAPTURE

    target, drafter = exported_drafter
    cfg = stage_config(
        tmp_path,
        target,
        **{
            "benchmark.enabled": False,
            "benchmark.num_warmup": 0,
            "benchmark.interleave": False,
            "evaluation.draft_steps": [1, 3],
            "evaluation.max_new_tokens": 12,
            "evaluation.num_prompts": 3,
        },
    )
    g = torch.Generator().manual_seed(11)
    prompts = [torch.randint(3, 512, (n,), generator=g).tolist() for n in (5, 17, 9, 30)]
    other = [torch.randint(3, 512, (n,), generator=g).tolist() for n in (12, 6)]
    sets = {
        "heldout": {"prompts": prompts, "source": None},
        "other": {"prompts": other, "source": {"file": "x"}},
    }
    progress = Progress()
    result = run_serve_bench(cfg, drafter, sets, log=lambda _: None, progress=progress)

    assert list(result.chains) == ["1/1/2", "3/1/4"] and result.speedup is None  # acceptance only
    # progress: each launch as it is up, then each prompt it answers, acceptance so far on a chain
    assert progress.launched_keys == ["plain", "1/1/2", "3/1/4"]
    # the plan told first: the prompts each launch then answered
    answered = {k: sum(a[0] == k for a in progress.answers) for k in progress.launched_keys}
    assert progress.plan == answered == {"plain": 5, "1/1/2": 5, "3/1/4": 5}
    for key in progress.launched_keys:
        mine = [a for a in progress.answers if a[0] == key]
        assert [(what, done, total) for _, what, done, total, _ in mine] == [
            *(("heldout", i, 3) for i in (1, 2, 3)),
            *(("other", i, 2) for i in (1, 2)),
        ], mine
        assert all((acc is None) == (key == "plain") for *_, acc in mine), mine
    last = [a for a in progress.answers if a[0] == "3/1/4" and a[1] == "other"][-1][-1]
    assert abs(last - result.chains["3/1/4"]["sets"]["other"]["acceptance_length"]) < 1e-3
    for steps, name in ((1, "1/1/2"), (3, "3/1/4")):
        for set_name, set_prompts in (("heldout", prompts[:3]), ("other", other)):
            served = result.chains[name]["sets"][set_name]
            local = evaluate_acceptance(
                drafter,
                target,
                set_prompts,
                EvaluationConfig(method="in_process", draft_steps=[steps], max_new_tokens=12),
                CAPTURE,
            ).settings[name]
            assert (
                served["per_prompt"] == local["per_prompt"]
            )  # tokens, verify steps, equality, per prompt
            assert served["acceptance_length"] == local["acceptance_length"]
            assert served["identical_to_target"] is True and served["num_prompts"] == len(
                set_prompts
            )
    ev = served_evaluation(result)  # report.json's evaluation section
    assert ev["method"] == "server" and ev["setting"] == "1/1/2" and ev["num_prompts"] == 3
    assert (
        ev["acceptance_length"]
        == result.acceptance_length
        == ev["settings"]["1/1/2"]["acceptance_length"]
    )
    per_set = benchmarks(result)
    assert per_set["other"]["source"] == {"file": "x"} and per_set["other"]["num_prompts"] == 2
    assert set(per_set["heldout"]["chains"]) == {"1/1/2", "3/1/4"}
    assert "| other | x | 2 |" in markdown(result) and "Speed at" not in markdown(result)


class Progress:
    """run_serve_bench's `progress`, recording what it is told."""

    def __init__(self):
        self.launched_keys, self.answers, self.plan = [], [], None

    def planned(self, prompts: dict[str, int]) -> None:
        self.plan = prompts

    def launched(self, key: str) -> None:
        self.launched_keys.append(key)

    def answered(self, key, what, done, total, acceptance) -> None:
        self.answers.append((key, what, done, total, acceptance))


def test_disabled_benchmark_with_in_process_evaluation_launches_nothing(prefect_harness, tmp_path):
    from eyas_prefect.flows.serve_bench import serve_bench_flow

    cfg = stage_config(
        tmp_path,
        ROOT / "fixtures" / "tiny-target",
        **{"benchmark.enabled": False, "evaluation.method": "in_process"},
    )
    assert serve_bench_flow(cfg, drafter_dir=str(tmp_path / "missing")) is None
    assert not (tmp_path / "server").exists()


def test_a_rerun_reports_the_cached_measurement_unless_refreshed(
    prefect_harness, exported_drafter, tmp_path
):
    from eyas_prefect.flows.serve_bench import serve_bench_flow

    target, drafter = exported_drafter
    cfg = stage_config(
        tmp_path,
        target,
        **{
            "benchmark.num_prompts": 1,
            "benchmark.max_new_tokens": 6,
            "benchmark.num_warmup": 0,
            "benchmark.num_repeats": 1,
            "benchmark.concurrency": 1,
            "benchmark.interleave": False,
            "benchmark.suites": [],
            "evaluation.draft_steps": [3],
            "evaluation.max_new_tokens": 6,
        },
    )
    prompts, log = (
        [[5, 6, 7, 8], [9, 10, 11]],
        Path(cfg.server.workdir) / "bench-plain" / "server.log",
    )

    def measured(run) -> tuple[ServeBenchResult, bool]:
        before = log.stat().st_mtime_ns if log.exists() else None
        result = run()
        return result, log.stat().st_mtime_ns != before

    first, launched = measured(
        lambda: serve_bench_flow(cfg, drafter_dir=str(drafter), prompts=prompts)
    )
    assert launched
    again, launched = measured(
        lambda: serve_bench_flow(cfg, drafter_dir=str(drafter), prompts=prompts)
    )
    assert again == first and not launched  # the same inputs: the cached figures, no server
    # (what else makes the key change: tests/unit/tasks/test_serve_bench.py)
    refresh = cfg.model_copy(update={"refresh": ["serve_bench"]})
    refreshed, launched = measured(
        lambda: serve_bench_flow(refresh, drafter_dir=str(drafter), prompts=prompts)
    )
    assert launched and refreshed.settings == first.settings


def test_the_drafter_is_uploaded_once_to_an_ssh_server_host(sshd, exported_drafter, tmp_path):
    from eyas.evaluation.serving import DRAFTER_FILES, stage_drafter
    from eyas.server.ssh_host import SSHHost
    from tests.sshd import ssh_config

    _, drafter = exported_drafter
    host_cfg = ssh_config(sshd)
    cfg = stage_config(
        tmp_path, ROOT / "fixtures" / "tiny-target", **{"server.host": host_cfg.model_dump()}
    )
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
