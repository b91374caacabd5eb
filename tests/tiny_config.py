"""The embedded tiny target's config (configs/local-tiny.yaml) with its outputs under a test's tmp
folder, and the config fields a preflight's problems name."""

from __future__ import annotations

from eyas.config import PipelineConfig, load_config
from tests.stage_config import ROOT

TINY = ROOT / "fixtures" / "tiny-target"
CONVERSATIONS = ROOT / "fixtures" / "data" / "conversations.jsonl"


def tiny(tmp_path, **overrides) -> PipelineConfig:
    return load_config(
        ROOT / "configs" / "local-tiny.yaml",
        {
            "run_dir": str(tmp_path / "run"),
            "extraction.output_dir": str(tmp_path / "shards"),
            "training.output_dir": str(tmp_path / "train"),
            **overrides,
        },
    )


def fields(result) -> list[str]:
    """The field each problem of a Preflight names ("target.layer_ids=[2, 4, 50]: ..." ->
    target.layer_ids)."""
    return [p.split(":", 1)[0].split("=", 1)[0] for p in result.problems]
