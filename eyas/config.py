"""The one typed configuration of an eyas run, loaded from YAML.

    cfg = load_config("configs/local-tiny.yaml")
    cfg = load_config("configs/local-tiny.yaml", {"training.max_steps": 50})

Every section forbids unknown keys, so a typo fails loudly instead of being ignored. Relative paths
are resolved against the directory of the YAML file, so a config means the same thing whatever the
current directory is. Paths on an SSH host must be absolute: they name files on that host.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator


class ConfigError(ValueError):
    """A config file that cannot be used; the message names the file, the field and the value."""


class StrictModel(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


LayerConvention = Literal["capture-before", "output-of"]


class TargetConfig(StrictModel):
    """The target model whose hidden states train the drafter."""

    checkpoint: Path  #: Hugging Face folder (config.json, *.safetensors, index) on the server host
    revision: str | None = None  #: recorded in manifests; e.g. a hub commit or a local tag
    layer_ids: list[int] = Field(min_length=1)  #: the aux layers, in `layer_convention`
    #: "capture-before": id i is the input of decoder layer i (SGLang's capture index, HF
    #: hidden_states[i]); "output-of": id i is the output of layer i (= capture-before i + 1).
    layer_convention: LayerConvention = "capture-before"

    @model_validator(mode="after")
    def _check_ids(self) -> "TargetConfig":
        ids = self.layer_ids
        if any(i < 0 for i in ids) or len(set(ids)) != len(ids) or ids != sorted(ids):
            raise ValueError(f"layer_ids must be distinct, non-negative and ascending, got {ids}")
        return self

    def capture_ids(self) -> list[int]:
        """Layer ids in the capture-before convention (what the server actually captures)."""
        shift = 1 if self.layer_convention == "output-of" else 0
        return [i + shift for i in self.layer_ids]


class HostConfig(StrictModel):
    """Where the server runs: this machine, or a GPU host reached over SSH (Fabric)."""

    kind: Literal["local", "ssh"] = "local"
    name: str = "localhost"  #: a label for run names and logs, e.g. gpu-node-1
    hostname: str | None = None  #: SSH only
    port: int = 22
    user: str | None = None
    key_filename: Path | None = None
    known_hosts: Path | None = None  #: host keys are checked against this file
    #: Fabric trusts any host key by default; eyas does not unless this is set on purpose.
    insecure_accept_any_host_key: bool = False
    connect_timeout_s: float = Field(10.0, gt=0)

    @model_validator(mode="after")
    def _check_ssh(self) -> "HostConfig":
        if self.kind == "ssh":
            if not self.hostname:
                raise ValueError("an ssh host needs hostname")
            if self.known_hosts is None and not self.insecure_accept_any_host_key:
                raise ValueError("an ssh host needs known_hosts (or insecure_accept_any_host_key: true)")
        return self


class ServerConfig(StrictModel):
    """How the target server is launched and reached."""

    backend: Literal["sglang", "local"] = "local"
    host: HostConfig = HostConfig()
    bind: str = "127.0.0.1"  #: address the server listens on (on its host)
    url_host: str | None = None  #: address the pipeline uses to reach it; default host.hostname or bind
    port: int = Field(30000, ge=1, le=65535)
    #: interpreter on the server host; None = this interpreter (local host) or python3 (ssh)
    python: str | None = None
    launch_args: list[str] = []  #: extra flags appended to the launch command
    env: dict[str, str] = {}  #: e.g. NCCL_PROTO, NCCL_ALGO, CUDA_VISIBLE_DEVICES
    workdir: Path  #: on the server host: holds the log and pid files
    dump_dir: Path  #: on the server host: where the hidden-state dump records land
    chunked_prefill_size: int = 8192  #: prefill chunk; the collector reassembles the chunks
    stop_timeout_s: float = Field(30.0, gt=0)

    @property
    def log_path(self) -> Path:
        return self.workdir / "server.log"

    @property
    def pid_path(self) -> Path:
        return self.workdir / "server.pid"

    @property
    def url(self) -> str:
        host = self.url_host or (self.host.hostname if self.host.kind == "ssh" else None) or self.bind
        return f"http://{host}:{self.port}"


class SensorConfig(StrictModel):
    """The readiness sensor that watches the server's log."""

    poll_interval_s: float = Field(1.0, gt=0)
    stall_timeout_s: float = Field(600.0, gt=0)  #: no loading progress for this long = failed
    deadline_s: float = Field(3600.0, gt=0)  #: not ready within this long = failed
    http_timeout_s: float = Field(5.0, gt=0)


class DataConfig(StrictModel):
    """The conversations the drafter is trained on."""

    path: Path  #: JSONL, one {"messages": [{"role", "content"}, ...]} per line
    #: tokenizer + chat template folder on this machine; None = target.checkpoint (local host)
    tokenizer: Path | None = None
    max_length: int = Field(512, gt=1)  #: tokens per sequence
    overlong: Literal["truncate", "drop"] = "truncate"
    num_heldout: int = Field(8, ge=0)  #: last N conversations: evaluation prompts, never trained on


class ExtractionConfig(StrictModel):
    """Sending sequences through the server and writing hidden-state shards."""

    output_dir: Path
    num_shards: int = Field(4, ge=1)
    concurrency: int = Field(4, ge=1)  #: requests in flight per server
    dtype: Literal["bfloat16", "float16", "float32"] = "bfloat16"
    request_timeout_s: float = Field(300.0, gt=0)
    record_timeout_s: float = Field(60.0, gt=0)  #: wait for dump records after the response


class DrafterShape(StrictModel):
    """Sizes of the EAGLE-3 draft layer; None means "same as the target"."""

    num_attention_heads: int | None = None
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    intermediate_size: int | None = None


class TrainingConfig(StrictModel):
    """EAGLE-3 drafter training."""

    output_dir: Path
    drafter: DrafterShape = DrafterShape()
    draft_vocab_size: int = Field(1024, gt=0)
    ttt_steps: int = Field(3, ge=1)  #: training-time-test unroll length
    loss_decay: float = Field(0.8, gt=0, le=1)  #: weight of TTT step k is loss_decay**k
    max_steps: int = Field(300, ge=1)
    batch_size: int = Field(4, ge=1)  #: sequences per step
    lr: float = Field(1e-3, gt=0)
    warmup_steps: int = Field(20, ge=0)
    weight_decay: float = Field(0.0, ge=0)
    grad_clip: float = Field(0.5, gt=0)
    seed: int = 0
    device: str = "auto"  #: "auto" = cuda if available else cpu
    checkpoint_every: int = Field(100, ge=1)


class EvaluationConfig(StrictModel):
    """Acceptance length of greedy chain speculative decoding against the target."""

    draft_steps: int = Field(3, ge=1)
    max_new_tokens: int = Field(64, ge=1)
    num_prompts: int = Field(8, ge=1)  #: taken from the held-out conversations
    device: str = "cpu"


class ExportConfig(StrictModel):
    """The drafter folder SGLang loads with --speculative-draft-model-path."""

    dtype: Literal["bfloat16", "float16", "float32"] = "bfloat16"


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

    @model_validator(mode="after")
    def _check_remote_paths(self) -> "PipelineConfig":
        if self.server.host.kind == "ssh":
            for name, p in [("target.checkpoint", self.target.checkpoint),
                            ("server.workdir", self.server.workdir),
                            ("server.dump_dir", self.server.dump_dir)]:
                if not p.is_absolute():
                    raise ValueError(f"{name} must be absolute on an ssh host, got {p}")
        return self


# Fields holding paths on this machine, or on the server host when that host is local.
_LOCAL_PATHS = ["run_dir", "data.path", "data.tokenizer", "extraction.output_dir", "training.output_dir"]
_SERVER_PATHS = ["target.checkpoint", "server.workdir", "server.dump_dir"]


def load_config(path: str | Path, overrides: dict[str, Any] | None = None) -> PipelineConfig:
    """Read a YAML config, apply dotted overrides ("training.max_steps": 5), validate, resolve paths."""
    path = Path(path)
    try:
        raw = yaml.safe_load(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"{path}: config file not found") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: not valid YAML: {e}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: expected a mapping at the top level, got {type(raw).__name__}")
    return config_from_dict(raw, base_dir=path.resolve().parent, source=str(path), overrides=overrides)


def config_from_dict(raw: dict[str, Any], base_dir: Path, source: str = "<dict>",
                     overrides: dict[str, Any] | None = None) -> PipelineConfig:
    """Validate a config mapping; relative local paths are resolved against base_dir."""
    raw = copy.deepcopy(raw)
    for dotted, value in (overrides or {}).items():
        _set_dotted(raw, dotted, value)
    try:
        cfg = PipelineConfig.model_validate(raw)
    except ValidationError as e:
        raise ConfigError(_describe(e, source)) from None
    fields = _LOCAL_PATHS + (_SERVER_PATHS if cfg.server.host.kind == "local" else [])
    for dotted in fields:
        _resolve(cfg, dotted, base_dir)
    return cfg


def _set_dotted(raw: dict, dotted: str, value: Any) -> None:
    *parents, leaf = dotted.split(".")
    node = raw
    for key in parents:
        node = node.setdefault(key, {})
    node[leaf] = value


def _resolve(cfg: BaseModel, dotted: str, base_dir: Path) -> None:
    *parents, leaf = dotted.split(".")
    node = cfg
    for key in parents:
        node = getattr(node, key)
    value = getattr(node, leaf)
    if value is not None and not Path(value).is_absolute():
        setattr(node, leaf, (base_dir / value).resolve())


def _describe(e: ValidationError, source: str) -> str:
    lines = [f"{source}: invalid config ({e.error_count()} problem(s))"]
    for err in e.errors():
        field = ".".join(str(p) for p in err["loc"]) or "<top level>"
        value = err.get("input")
        shown = repr(value) if not isinstance(value, dict) else "{...}"
        lines.append(f"  - {field}: {err['msg']} (got {shown})")
    return "\n".join(lines)
