"""The plan section: the throughputs `eyas preflight` plans with."""

from __future__ import annotations

from pydantic import Field

from eyas.config.base import StrictModel


class PlanConfig(StrictModel):
    """Figures `eyas preflight` plans with (eyas/plan.py). Defaults: the 2-core development machine
    on the embedded tiny target (docs/performance.md); put measured figures here for real
    hardware."""

    #: prompt tokens/s one target server prefills with capture on; each extraction.endpoints server
    #: counts the same again (report.json's extraction tokens/s is the measured figure)
    prefill_tokens_per_s: float = Field(4000.0, gt=0)
    #: tokens/s one server generates over its concurrent requests (data.regenerate)
    decode_tokens_per_s: float = Field(350.0, gt=0)
    #: training tokens/s per training process (every position of every sequence, TTT included)
    train_tokens_per_s: float = Field(6000.0, gt=0)
    gpu_memory_gb: float | None = Field(
        None, gt=0
    )  #: one training GPU; None = estimate printed only
