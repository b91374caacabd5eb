"""PipelineConfig: one eyas run, its sections assembled (one module per section in eyas/config/,
loading in eyas/config/loading.py). Every field carries a comment saying what it is for.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, model_validator

from eyas.config.base import StrictModel
from eyas.config.data import DataConfig
from eyas.config.evaluation import BenchmarkConfig, EvaluationConfig, ExportConfig
from eyas.config.extraction import ExtractionConfig
from eyas.config.plan import PlanConfig
from eyas.config.server import SensorConfig, ServerConfig
from eyas.config.target import TargetConfig
from eyas.config.training import TrainingConfig


class PipelineConfig(StrictModel):
    """One eyas run, end to end."""

    name: str = Field(pattern=r"^[A-Za-z0-9_.-]+$")
    run_dir: Path  #: report.json and drafter/ land here
    target: TargetConfig
    server: ServerConfig
    sensor: SensorConfig = SensorConfig()
    data: DataConfig
    extraction: ExtractionConfig
    training: TrainingConfig
    evaluation: EvaluationConfig = EvaluationConfig()
    export: ExportConfig = ExportConfig()
    benchmark: BenchmarkConfig = BenchmarkConfig()
    plan: PlanConfig = PlanConfig()  #: throughputs for `eyas preflight`'s plan
    #: cached stages to recompute although their inputs did not change (to re-measure, say); the
    #: cache record is overwritten. Shards: delete the file (a missing or damaged one is redone).
    refresh: list[Literal["evaluate", "serve_bench"]] = []

    @model_validator(mode="before")
    @classmethod
    def _no_data_tokenizer(cls, raw):
        """data.tokenizer is not a field: the orchestrator's copy of the target is
        target.local_dir."""
        data = raw.get("data") if isinstance(raw, dict) else None
        if isinstance(data, dict) and "tokenizer" in data:
            raise ValueError(
                "data.tokenizer is not a field: the target's tokenizer and config on this machine "
                "are target.local_dir"
            )
        return raw

    @model_validator(mode="after")
    def _target_stays_in_sglang(self) -> "PipelineConfig":
        if self.evaluation.method == "in_process" and self.server.backend == "sglang":
            raise ValueError(
                "evaluation.method: in_process loads the whole target into this process; with "
                "server.backend sglang only SGLang loads it: use evaluation.method: server"
            )
        return self

    @model_validator(mode="after")
    def _reference_beside_sglang(self) -> "PipelineConfig":
        if self.benchmark.reference_backend and (
            self.server.backend != "sglang" or self.server.host.kind != "local"
        ):
            raise ValueError(
                f"benchmark.reference_backend: {self.benchmark.reference_backend} "
                f"serves the drafter on eyas's own server beside SGLang on this machine: it needs "
                f"server.backend sglang on a "
                f"local host, got {self.server.backend} on {self.server.host.kind}"
            )
        return self

    @model_validator(mode="after")
    def _bench_env_not_secret(self) -> "PipelineConfig":
        if twice := set(self.benchmark.server_env) & (
            set(self.server.secret_env) | set(self.server.env_from)
        ):
            raise ValueError(
                f"benchmark.server_env: {sorted(twice)} also set in server.secret_env or "
                f"server.env_from"
            )
        return self

    @model_validator(mode="after")
    def _check_remote_paths(self) -> "PipelineConfig":
        if self.server.host.kind == "ssh":
            for name, p in [
                ("target.checkpoint", self.target.checkpoint),
                ("server.workdir", self.server.workdir),
                ("server.dump_dir", self.server.dump_dir),
            ]:
                if not p.is_absolute():
                    raise ValueError(f"{name} must be absolute on an ssh host, got {p}")
        return self
