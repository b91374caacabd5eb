"""A PipelineConfig for stage tests: the embedded default pointed at a given target and temp
dirs."""

from pathlib import Path

from eyas.config import PipelineConfig, load_config
from eyas.net import free_port
from tests.helpers_training import CAPTURE

ROOT = Path(__file__).resolve().parents[1]


def stage_config(tmp: Path, target: Path, **overrides) -> PipelineConfig:
    """configs/local-tiny.yaml on `target`; its draft vocabulary shrunk to fit a smaller target's,
    its capture layers those the tests' shards hold (tests/helpers_training.py)."""
    import json

    draft_vocab = (
        2048  # a stand-in target without a vocabulary (the patch tests' config.json) keeps it
    )
    config = Path(target) / "config.json"
    if config.exists():
        draft_vocab = min(
            draft_vocab, json.loads(config.read_text()).get("vocab_size", draft_vocab)
        )
    return load_config(
        ROOT / "configs" / "local-tiny.yaml",
        {
            "target.checkpoint": str(target),
            "run_dir": str(tmp / "run"),
            "server.port": free_port(),
            "server.workdir": str(tmp / "server"),
            "server.dump_dir": str(tmp / "server" / "dump"),
            "server.chunked_prefill_size": 16,
            "extraction.output_dir": str(tmp / "shards"),
            "training.output_dir": str(tmp / "train"),
            "sensor.poll_interval_s": 0.1,
            "training.draft_vocab_size": draft_vocab,
            "target.layer_ids": CAPTURE,
            # one replica: the tests that signal or count a server's processes
            "server.dp_size": None,
            **overrides,
        },
    )
