"""What the stages hand each other: small frozen records of the stages' own dataclasses.

    up = ServerUp(handle, ready, patch, stages)                                  # flows/serve.py
    extracted = Extracted(manifests, prompts, data_stats, patch, ready, stages)  # flows/extract.py
    trained = Trained(result, drafter_dir, evaluation, stages)                   # flows/train.py
    # eyas/report.py
    report = build_report(name=..., extracted=..., trained=..., serving=..., stages=...)

The fields hold the objects the stages made (ServerHandle, ReadyReport, PatchReport, ShardManifest,
TrainResult, EvalResult), never their dict forms: JSON is made once, where it is written
(eyas/report.py). Prefect keeps task results with its default pickle serializer, which stores
these dataclasses as they are.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # training and evaluation import torch; a record needs none of it to exist
    from eyas.evaluation.evaluate import EvalResult
    from eyas.extraction.shards import ShardManifest
    from eyas.server.launch import ServerHandle
    from eyas.server.readiness import ReadyReport
    from eyas.server.sglang_patch import PatchReport
    from eyas.training.train import TrainResult


@dataclass(frozen=True)
class ServerUp:
    """A launched, ready server (flows/serve.py)."""

    handle: ServerHandle  # pid, url, log path and offset, who launched it
    ready: ReadyReport  # seconds to ready, shards_total, the last loading bar
    patch: PatchReport  # what the patch stage found or applied
    stages: dict[str, float] = field(default_factory=dict)  # seconds per stage


@dataclass(frozen=True)
class Extracted:
    """Shards on disk and what evaluation needs from the data (flows/extract.py)."""

    manifests: list[ShardManifest]  # one per shard, in plan order (docs/data-format.md)
    prompts: list[list[int]]  # held-out prompts, token ids
    data_stats: dict  # prepare-data's counts (JSON as report.json shows them)
    patch: PatchReport
    ready: ReadyReport | None = None  # None when every shard was intact and no server was launched
    stages: dict[str, float] = field(default_factory=dict)
    #: why the target server died each time it was relaunched during extraction (at most once)
    relaunches: list[str] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(m.num_tokens for m in self.manifests)


@dataclass(frozen=True)
class Trained:
    """A trained and exported drafter, evaluated in process where so configured (flows/train.py)."""

    result: TrainResult
    drafter_dir: str  # the exported folder SGLang loads
    evaluation: (
        EvalResult | None
    )  # None: measured by serving the drafter instead (flows/serve_bench.py)
    stages: dict[str, float] = field(default_factory=dict)
