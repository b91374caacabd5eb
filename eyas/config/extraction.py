"""The extraction section: sequences sent through the target's servers, hidden-state shards
written."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, model_validator

from eyas.config.base import StrictModel
from eyas.config.hosts import HostConfig


class EndpointConfig(StrictModel):
    """A further target server that extraction sends requests to (started outside this flow)."""

    url: str = Field(pattern=r"^https?://")  #: e.g. http://gpu-node-2:30000
    #: where that server writes dump records: a path on `host` when it is set, else on this machine
    dump_dir: Path
    #: the machine that server dumps on (an ssh host, as server.host): its records are read here
    #: when dump_dir is visible here at the same path, else through SSH; None = this machine
    host: HostConfig | None = None
    concurrency: int | None = Field(
        None, ge=1
    )  #: requests in flight there; None = extraction.concurrency

    @model_validator(mode="after")
    def _check_dump_dir(self) -> "EndpointConfig":
        if not self.dump_dir.is_absolute():
            raise ValueError(f"endpoint {self.url}: dump_dir must be absolute, got {self.dump_dir}")
        return self


class ExtractionConfig(StrictModel):
    """Sending sequences through the server and writing hidden-state shards."""

    output_dir: Path
    num_shards: int = Field(4, ge=1)
    concurrency: int = Field(4, ge=1)  #: requests in flight per server (over all shards at once)
    dtype: Literal["bfloat16", "float16", "float32"] = "bfloat16"
    #: "plain" stores hidden states in `dtype`; "fp8_e4m3" stores e4m3 with one float32 scale per
    #: token and layer (about half the bytes; readers get bf16 back; error in each manifest)
    encoding: Literal["plain", "fp8_e4m3"] = "plain"
    request_timeout_s: float = Field(300.0, gt=0)
    record_timeout_s: float = Field(60.0, gt=0)  #: wait for dump records after the response
    #: transient failures (connection lost, timeout, 5xx) are retried this often per sequence,
    #: with exponential backoff from retry_backoff_s, on any server not backing off
    request_retries: int = Field(5, ge=0)
    retry_backoff_s: float = Field(2.0, gt=0)
    #: no request completed for this long while some are in flight, and no server answers /health:
    #: extraction and regeneration fail at once with "server stalled" (a slow server that answers
    #: /health only restarts the clock)
    stall_timeout_s: float = Field(600.0, gt=0)
    collect_workers: int = Field(
        2, ge=1
    )  #: sequences validated and written at once (bounds memory)
    #: refuse to start when the output disk would have less than this left after extraction
    keep_free_gb: float = Field(1.0, ge=0)
    #: more servers of the same target, besides the one the flow launches; requests go to whichever
    #: has a free slot, each with at most its concurrency in flight
    endpoints: list[EndpointConfig] = []
