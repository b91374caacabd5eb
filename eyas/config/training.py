"""The training section: the EAGLE-3 drafter's shape, recipe and the processes that train it."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, model_validator

from eyas.config.base import EnvName, StrictModel
from eyas.config.hosts import HostConfig

# How a training field is held on resume, marked on the field (json_schema_extra). The training
# fingerprint (TrainingConfig.fingerprint_settings, eyas/training/train.py) holds every field not
# marked MAY_CHANGE, and a checkpoint whose fingerprint differs from the call's is another run's.
#: how a run is carried out, not what its weights become: where and how often it writes and
#: evaluates, its devices and ranks, the micro-batches a global batch is cut into (the global batch
#: is fingerprinted apart), its kernels, caches, loader threads and disk probe
MAY_CHANGE = {"resume": "may change"}
#: fingerprinted only where not its default: a field added after checkpoints were written without
#: it, which then still resume a run that leaves it at the default
ONLY_WHERE_SET = {"resume": "only where set"}


class DrafterShape(StrictModel):
    """Sizes of the EAGLE-3 draft layer; None means "same as the target"."""

    num_attention_heads: int | None = None
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    intermediate_size: int | None = None


class DistributedConfig(StrictModel):
    """Training on several processes through torchrun, launched through the Host seam
    (eyas/training/distributed.py).

    The default (one process, one host) trains inside the flow's own process. Shards and
    training.output_dir must be on a filesystem every training host sees at the same paths.
    """

    nproc_per_node: int = Field(1, ge=1)  #: processes per node, one per GPU
    #: one host per node; empty = this machine. Node 0's hostname is the rendezvous address.
    hosts: list[HostConfig] = []
    strategy: Literal["ddp", "fsdp"] = "ddp"  #: fsdp shards gradients and optimizer state (ZeRO-2)
    master_port: int = Field(29511, ge=1, le=65535)
    python: str | None = (
        None  #: interpreter on the training hosts; None = this one (local) or python3
    )
    env: dict[EnvName, str] = {}  #: e.g. NCCL_SOCKET_IFNAME, CUDA_VISIBLE_DEVICES
    timeout_s: float = Field(7 * 24 * 3600.0, gt=0)  #: the whole run, all nodes

    @property
    def launched(self) -> bool:
        """True when training runs under torchrun rather than in the calling process."""
        return (
            self.nproc_per_node > 1
            or len(self.hosts) > 1
            or any(h.kind == "ssh" for h in self.hosts)
        )


class TrainingConfig(StrictModel):
    """EAGLE-3 drafter training (docs/training.md explains every field)."""

    output_dir: Path = Field(json_schema_extra=MAY_CHANGE)
    drafter: DrafterShape = DrafterShape()
    draft_vocab_size: int = Field(1024, gt=0)
    ttt_steps: int = Field(3, ge=1)  #: training-time-test unroll length
    loss_decay: float = Field(0.8, gt=0, le=1)  #: weight of TTT step k is loss_decay**k
    #: which predicted tokens carry a label: "assistant" (the loss mask) or "all" (every real token;
    #: more signal on small data, the prompt's tokens included). The draft vocab is counted on the
    #: mask.
    loss_positions: Literal["assistant", "all"] = "assistant"
    max_steps: int = Field(300, ge=1)  #: optimizer steps
    #: sequences per micro-batch, per process
    batch_size: int = Field(4, ge=1, json_schema_extra=MAY_CHANGE)
    #: micro-batches per optimizer step, per process
    grad_accum: int = Field(1, ge=1, json_schema_extra=MAY_CHANGE)
    #: global batches per length-sorting window: sequences of similar length share a micro-batch
    #: (less padding); 1 = plain shuffled batches
    length_grouping: int = Field(16, ge=1)
    lr: float = Field(1e-3, gt=0)  #: peak learning rate (AdamW, betas 0.9/0.95)
    warmup_steps: int = Field(20, ge=0)  #: linear warmup, then cosine decay to 10% of the peak
    weight_decay: float = Field(0.0, ge=0)
    grad_clip: float = Field(0.5, gt=0)  #: max global gradient norm
    #: the final weights are an exponential moving average of the trained ones, this decay per step
    #: (eyas/training/ema.py; ~1/(1-decay) steps averaged); 0 = off, the last step's weights
    ema_decay: float = Field(0.0, ge=0, lt=1, json_schema_extra=ONLY_WHERE_SET)
    #: training-only augmentation (as EAGLE did): Gaussian noise on the target's captured states,
    #: this many times each token's RMS per layer; 0 = off. Evaluation and export never see it.
    aux_noise: float = Field(0.0, ge=0)
    #: on GPU: bf16 autocast over fp32 master weights; on a CPU with AMX or AVX512-BF16: bf16 GEMMs,
    #: the rest fp32
    precision: Literal["bf16", "fp32"] = "bf16"
    #: fuse the elementwise regions with torch.compile (eyas/training/kernels.py); None = on a GPU
    #: only
    compile: bool | None = Field(None, json_schema_extra=MAY_CHANGE)
    #: EXPERIMENTAL: the drafter layer's GEMMs in FP8 (e4m3, row-wise scales; a GPU with FP8 units,
    #: Hopper or newer), the head and the teacher in bf16. 1.1-1.25x faster steps, but one step's
    #: gradients lie 60% from fp32's (bf16: 6%) and no drafter trained with it has been evaluated:
    #: docs/performance.md "FP8 GEMMs (experimental)"
    fp8_gemms: bool = False
    #: on a CPU: the teacher's labels of every sequence computed once (not once per batch) when they
    #: fit in this much memory (tokens x draft_vocab_size x 4 bytes;
    #: eyas/training/teacher_cache.py); 0 = per batch, as on a GPU always (then each position's
    #: full-vocabulary argmax bit is remembered from its sequence's first epoch:
    #: teacher_cache.ArgmaxMemo)
    teacher_cache_gb: float = Field(2.0, ge=0, json_schema_extra=MAY_CHANGE)
    #: threads that read, collate and pin the coming micro-batches while the step runs (the copy to
    #: the GPU overlaps it too: eyas/training/loader.py); 0 = synchronously inside the step. One
    #: reads a Kimi-size micro-batch of 4 (0.94 GB) in ~0.2 s from the page cache
    #: (docs/performance.md, "The data path"). None = 2 on a GPU, 0 on a CPU, whose step already
    #: uses every core. The same batches either way
    loader_workers: int | None = Field(None, ge=0, json_schema_extra=MAY_CHANGE)
    #: the shard folder's read rate against what the planned training speed needs (eyas preflight:
    #: a short probe with the page cache dropped): "warn" notes a disk too slow, "refuse" makes it a
    #: problem, "off" skips the probe
    disk_check: Literal["warn", "refuse", "off"] = Field("warn", json_schema_extra=MAY_CHANGE)
    seed: int = 0
    #: "auto" = cuda if available else cpu
    device: str = Field("auto", json_schema_extra=MAY_CHANGE)
    checkpoint_every: int = Field(100, ge=1, json_schema_extra=MAY_CHANGE)
    #: the last shard sequences, kept out of training: the simulated acceptance length is measured
    #: on them; None = 5% of the data, at most 64. (data.num_heldout is another thing: the
    #: conversations kept back before extraction as evaluation prompts.)
    num_validation_sequences: int | None = Field(None, ge=0)
    #: simulated acceptance length every N steps (0 = at the end only)
    eval_every: int = Field(0, ge=0, json_schema_extra=MAY_CHANGE)
    #: warm start: the drafter begins as this one (an exported drafter folder such as an earlier
    #: run's run_dir/drafter, a checkpoint step-NNNNNN/, or another run's training output_dir) with
    #: its draft vocabulary; optimizer, schedule and step start fresh. Sizes must match (refused
    #: naming the field); ttt_steps and the recipe may differ. Checkpoints of another run in
    #: output_dir are set aside to checkpoints.previous/ instead of refused; this run's own are
    #: resumed. None = from the target
    init_from: Path | None = None
    distributed: DistributedConfig = Field(DistributedConfig(), json_schema_extra=MAY_CHANGE)

    @model_validator(mode="before")
    @classmethod
    def _num_heldout_is_a_data_setting(cls, raw):
        """training.num_heldout is refused with the name it means: the two held-out counts
        differ."""
        if isinstance(raw, dict) and "num_heldout" in raw:
            raise ValueError(
                "num_heldout is not a training setting: the shard sequences kept out of training "
                "are training.num_validation_sequences; the conversations kept back as "
                "evaluation prompts are data.num_heldout"
            )
        return raw

    @classmethod
    def marked(cls, mark: dict) -> set[str]:
        """The fields marked `mark` (MAY_CHANGE, ONLY_WHERE_SET)."""
        return {n for n, f in cls.model_fields.items() if f.json_schema_extra == mark}

    def fingerprint_settings(self) -> dict:
        """The settings a checkpoint must share with this run to be resumed: every field but those
        marked MAY_CHANGE, those marked ONLY_WHERE_SET only where not their default."""
        settings = self.model_dump(mode="json", exclude=self.marked(MAY_CHANGE))
        for name in self.marked(ONLY_WHERE_SET):
            if getattr(self, name) == type(self).model_fields[name].default:
                settings.pop(name)
        return settings
