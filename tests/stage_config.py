"""A PipelineConfig for stage tests: the embedded default pointed at a given target and temp dirs."""

from pathlib import Path

from eyas.config import PipelineConfig, load_config
from eyas.server.hosts import free_port

ROOT = Path(__file__).resolve().parents[1]




def stage_config(tmp: Path, target: Path, **overrides) -> PipelineConfig:
    return load_config(ROOT / "configs" / "local-tiny.yaml", {
        "target.checkpoint": str(target), "run_dir": str(tmp / "run"), "server.port": free_port(),
        "server.workdir": str(tmp / "server"), "server.dump_dir": str(tmp / "server" / "dump"),
        "server.chunked_prefill_size": 16, "extraction.output_dir": str(tmp / "shards"),
        "training.output_dir": str(tmp / "train"), "sensor.poll_interval_s": 0.1, **overrides})
