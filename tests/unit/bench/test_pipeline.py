"""bench/pipeline.py's parts: the README command it times, the seed runs' dirs, the goal line, the
machine's speed probe."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))

from bench import pipeline  # noqa: E402 - bench/ is a folder of scripts, found through sys.path


def test_readme_command_is_the_first_bash_block():
    command = pipeline.readme_command((ROOT / "README.md").read_text())
    assert command.startswith("python3 -m venv .venv") and command.endswith(
        "eyas run configs/local-tiny.yaml"
    )
    with pytest.raises(ValueError):
        pipeline.readme_command("```bash\npytest -q\n```\n")


def test_seed_runs_share_the_shards_and_nothing_else(tmp_path):
    a, b = (pipeline.seed_overrides(tmp_path, s, tmp_path / "shards") for s in (1, 2))
    assert a["training.seed"] == 1 and a["extraction.output_dir"] == b["extraction.output_dir"]
    for key in ("run_dir", "server.workdir", "training.output_dir"):
        assert a[key] != b[key] and Path(a[key]).is_relative_to(tmp_path / "seed-1")


def test_goals_mean_over_seeds_and_the_time_measured():
    g = pipeline.goals(2.04, {0: 2.04, 1: 1.9, 2: 2.0}, readme_s=479.0, flow_s=0.0)
    assert g["acceptance_length"]["met"] and g["readme_run_seconds"]["met"]
    assert g["mean_acceptance_3_seeds"] == {
        "value": 1.98,
        "goal": ">= 2.0",
        "met": False,
        "seeds": [0, 1, 2],
    }
    g = pipeline.goals(1.99, {0: 1.99}, readme_s=None, flow_s=601.0)
    assert set(g) == {"acceptance_length", "pipeline_wall_seconds"}
    assert not g["acceptance_length"]["met"] and not g["pipeline_wall_seconds"]["met"]


def test_the_machine_probe_times_the_training_step_in_a_process_of_its_own():
    assert pipeline.machine_step_ms(0) is None
    probe = pipeline.machine_step_ms(1)  # after 3 warm-up steps of each mode
    assert set(probe) <= {"fp32_step_ms", "bf16_gemms_step_ms"} and "fp32_step_ms" in probe
    assert all(ms > 0 for ms in probe.values())
