"""What the stages hand each other: small frozen records instead of dicts read by key.

    up = ServerUp(handle, ready, patch, stages)                       # flows/serve.py
    extracted = Extracted(manifests, prompts, data_stats, ready, patch, stages)   # flows/extract.py
    trained = Trained(result, drafter_dir, evaluation, stages)       # flows/train.py
    report = build_report(cfg_name, source, extracted, trained, serving, stages)  # eyas/report.py

Their fields stay JSON-able (dicts of numbers and strings) so Prefect can keep them as results.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class ServerUp:
    """A launched, ready server (flows/serve.py)."""

    handle: dict                  # launch.ServerHandle.to_dict(): pid, url, log path and offset
    ready: dict                   # readiness.ReadyReport as a dict: seconds, shards_total, ...
    patch: dict                   # what the patch stage found or applied
    stages: dict[str, float] = field(default_factory=dict)  # seconds per stage


@dataclass(frozen=True)
class Extracted:
    """Shards on disk and what evaluation needs from the data (flows/extract.py)."""

    manifests: list[dict]         # one per shard, in plan order (docs/data-format.md)
    prompts: list[list[int]]      # held-out prompts, token ids
    data_stats: dict              # prepare-data's counts
    patch: dict
    ready: dict | None = None     # None when every shard was intact and no server was launched
    stages: dict[str, float] = field(default_factory=dict)

    @property
    def num_tokens(self) -> int:
        return sum(m["num_tokens"] for m in self.manifests)


@dataclass(frozen=True)
class Trained:
    """A trained and exported drafter, evaluated in process where so configured (flows/train.py)."""

    result: dict                  # training.train.TrainResult as a dict
    drafter_dir: str              # the exported folder SGLang loads
    evaluation: dict | None       # evaluation.evaluate.EvalResult as a dict; None: served instead
    stages: dict[str, float] = field(default_factory=dict)
