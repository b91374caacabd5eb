"""The server and sensor sections: how the target server is launched, reached and watched."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, SecretStr, field_serializer, field_validator, model_validator

from eyas.config.base import Address, EnvName, StrictModel
from eyas.config.hosts import HostConfig
from eyas.secrets import looks_secret, redact_args


class ServerConfig(StrictModel):
    """How the target server is launched and reached."""

    backend: Literal["sglang", "local"] = "local"
    host: HostConfig = HostConfig()
    bind: Address = "127.0.0.1"  #: address the server listens on (on its host)
    url_host: Address | None = (
        None  #: address the pipeline uses to reach it; default host.hostname or bind
    )
    port: int = Field(30000, ge=1, le=65535)
    #: interpreter on the server host; None = this interpreter (local host) or python3 (ssh). On a
    #: local host `~` is expanded and a relative path is read from the config file's folder
    python: str | None = None
    #: extra flags appended to every launch command, capture and serving (an --api-key value is
    #: never shown)
    launch_args: list[str] = []
    #: every launch's environment, e.g. CUDA_VISIBLE_DEVICES, NCCL_ALGO; shown and stored: no
    #: secrets
    env: dict[EnvName, str] = {}
    #: flags for the capture (extraction) launch only, after launch_args: e.g. --disable-cuda-graph;
    #: the serving benchmark's launches take benchmark.launch_args instead
    capture_launch_args: list[str] = []
    #: the capture launch's environment over env (EYAS_DUMP_DIR is set there and nowhere else)
    capture_env: dict[EnvName, str] = {}
    #: how SGLang writes dump records: "forward_hook" registers eyas's hook through --forward-hooks
    #: and changes no SGLang file; "source_patch" also patches models/deepseek_v2.py, for SGLang
    #: builds without --forward-hooks (the capture launch then passes none). The local backend
    #: ignores it.
    capture: Literal["forward_hook", "source_patch"] = "forward_hook"
    #: secret values for the server's environment, from a config file on the worker: never printed,
    #: stored with a run, nor put on a command line (docs/operations.md, "Secrets")
    secret_env: dict[EnvName, SecretStr] = {}
    #: server variables copied at launch from the environment of the process running the flow:
    #: [HF_TOKEN] (same name) or {HF_TOKEN: NAME_THERE}; only the names travel with the run
    env_from: dict[EnvName, EnvName] = {}
    workdir: Path  #: on the server host: holds the log and pid files
    dump_dir: Path  #: on the server host: where the hidden-state dump records land
    chunked_prefill_size: int = 8192  #: prefill chunk; the collector reassembles the chunks
    #: requests decoded together by the extraction server (SGLang's --max-running-requests); None =
    #: the backend's default (SGLang: sized from memory; eyas-local: one at a time). The serving
    #: benchmark's launches leave it out: eyas-local's speculative path runs one request at a time.
    max_running_requests: int | None = Field(None, ge=1)
    #: replicas of the model in the extraction server (SGLang's --dp-size: data-parallel workers,
    #: one GPU group each); None = the backend's default (1). eyas-local: copies on a core each. The
    #: serving benchmark's launches leave it out, as max_running_requests
    dp_size: int | None = Field(None, ge=1)
    stop_timeout_s: float = Field(30.0, gt=0)

    @field_validator("env_from", mode="before")
    @classmethod
    def _same_names(cls, v):
        return {n: n for n in v} if isinstance(v, (list, tuple)) else v

    @model_validator(mode="after")
    def _check_env(self) -> "ServerConfig":
        for name in self.env:
            if looks_secret(name):
                raise ValueError(
                    f"server.env.{name} looks like a secret, and env values are shown and stored: "
                    f"use server.env_from (copied from the worker's environment) or "
                    f"server.secret_env"
                )
        for name in self.capture_env:
            if looks_secret(name):
                raise ValueError(
                    f"server.capture_env.{name} looks like a secret, and env values are shown and "
                    f"stored: use server.env_from or server.secret_env"
                )
        plain, secret, copied = (
            set(self.env) | set(self.capture_env),
            set(self.secret_env),
            set(self.env_from),
        )
        if twice := (plain & secret) | (plain & copied) | (secret & copied):
            raise ValueError(
                f"server: {sorted(twice)} set in more than one of env, secret_env, env_from "
                f"(capture_env counts as env)"
            )
        return self

    @field_serializer("launch_args", "capture_launch_args", when_used="json")
    def _hide_secret_flags(self, v: list[str]) -> list[str]:
        return redact_args(v)  # what Prefect stores as a run's parameters, and check-config prints

    @property
    def log_path(self) -> Path:
        return self.workdir / "server.log"

    @property
    def pid_path(self) -> Path:
        return self.workdir / "server.pid"

    @property
    def url(self) -> str:
        host = (
            self.url_host or (self.host.hostname if self.host.kind == "ssh" else None) or self.bind
        )
        return f"http://{host}:{self.port}"


class SensorConfig(StrictModel):
    """The readiness sensor that watches the server's log."""

    poll_interval_s: float = Field(1.0, gt=0)
    stall_timeout_s: float = Field(600.0, gt=0)  #: no loading progress for this long = failed
    deadline_s: float = Field(3600.0, gt=0)  #: not ready within this long = failed
    http_timeout_s: float = Field(5.0, gt=0)
