"""What a run will take, worked out before any GPU is touched: tokens, shard bytes, hours per stage
and the drafter's training memory. `eyas preflight` (eyas/preflight/) checks and prints it.

    # DataCount; DataError on a bad line
    count = count_tokens(cfg.data, tokenizer, vocab_size=163840)
    plan = make_plan(cfg, tcfg, count, free_bytes=free)              # Plan
    print("\\n".join(plan_lines(plan)))

**Tokens.** A data file of at most SMALL_DATA_BYTES is read whole by the prepare stage's own reader
(eyas/extraction/data.py load_records, which checks every line): pre-tokenized records count their
ids; conversations are rendered with the chat template when the tokenizer is given, else counted at
BYTES_PER_TOKEN_TEXT bytes of their JSON line per token. A larger file is not read whole: its lines
are counted and its tokens are its size over the bytes per token of its first SAMPLE_LINES lines
(rendered when the tokenizer is given, else at the documented ratio for their kind). Either way,
data.max_length and data.overlong apply per sequence and the last data.num_heldout records are left
out, as prepare does (prepare also drops sequences without an assistant token: not counted here).

**Bytes.** tokens x bytes_per_token (eyas/extraction/shards.py: (K aux layers + the last) x hidden x
2 B in bf16 plus 5 B of id and mask; fp8_e4m3 one byte per value plus a float32 scale per token and
layer, about half), plus each shard's header bound and 8 B per sample offset.

**Reading.** A training node reads plan.train_tokens_per_s x processes per node x bytes per token of
shards (read_bytes_per_s); preflight probes the shard folder's rate on the first training host
(eyas/preflight/disk.py, training.disk_check).

**Hours.** extract = tokens / (plan.prefill_tokens_per_s x servers), servers = 1 +
len(extraction.endpoints); regenerate = assistant turns x data.regenerate.max_new_tokens /
(plan.decode_tokens_per_s x servers); train = max_steps x global batch x mean sequence tokens /
(plan.train_tokens_per_s x processes).

**Memory** of one training process (training_memory): fp32 master weights, gradients and AdamW
moments of the trainable parameters (16 B each; FSDP shards all but the weights over the processes;
4 B more, sharded alike, for training.ema_decay's weight average),
the frozen embedding and target head, the teacher's and the fused head's transient chunks, and
activations per token: the batch's hidden states and teacher distribution once, and each TTT step's
saved layer activations. For the Kimi-K2.5 drafter it is within 6% of the peaks measured on an H200
(docs/performance.md: 34.1, 43.2, 61.4 and 97.9 GB at batch 1, 2, 4, 8). The plan also gives it at
PLAN_LENGTHS (8k and 16k tokens) and data.max_length for 1, 2 and 4 sequences per micro-batch, to
choose the training length against plan.gpu_memory_gb (activations grow linearly with tokens: the
drafter's attention never forms the T x T scores, eyas/training/attention.py).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

from eyas.config import DataConfig, PipelineConfig
from eyas.extraction.data import DataError, Record, load_records, render_chat

SMALL_DATA_BYTES = (
    8 << 20
)  #: data files up to this size are read whole (and tokenized when possible)
SAMPLE_LINES = 200  #: lines of a larger file read to find its bytes per token
#: conversations JSONL, bytes of the JSON line per token: English prose runs about 4 characters per
#: token with a 100k-200k BPE vocabulary and the JSON keys add a little; code and chat templates'
#: special tokens go lower (the tiny target's fixture conversations: 3.76). Set below both, so the
#: estimate errs towards more tokens, bytes and hours.
BYTES_PER_TOKEN_TEXT = 3.5
#: pre-tokenized JSONL: a 5-6 digit id and ", " in input_ids plus "1, " in loss_mask per token
BYTES_PER_TOKEN_IDS = 10.0
GB = 1e9
#: sequence lengths whose training memory the plan also prints (besides data.max_length), at
#: PLAN_BATCHES sequences per micro-batch: long-context choices weighed against one GPU's memory
PLAN_LENGTHS = (8192, 16384)
PLAN_BATCHES = (1, 2, 4)
#: the memory model's error against the peaks measured (module docstring): a figure within this
#: share of plan.gpu_memory_gb is marked as not fitting in the by-length line
MEMORY_MARGIN = 0.06


@dataclass(frozen=True)
class DataCount:
    sequences: int  #: training sequences after hold-out and the length policy
    tokens: int  #: their tokens, as extraction will send them
    assistant_turns: int  #: assistant turns of those conversations (regeneration's work)
    conversations: bool  #: some records are conversations (they need the chat template)
    source: str  #: how the tokens were found
    bad_lines: tuple[str, ...] = ()  #: every bad line read, "file:line[:column]: reason"


@dataclass(frozen=True)
class Stage:
    name: str
    tokens: int
    tokens_per_s: float  #: over all servers or processes
    detail: str = ""

    @property
    def hours(self) -> float:
        return self.tokens / self.tokens_per_s / 3600


@dataclass(frozen=True)
class Plan:
    num_shards: int
    data: DataCount | None = None
    bytes_per_token: int | None = None
    total_bytes: int | None = None  #: all shards, headers included
    free_bytes: int | None = None  #: at extraction.output_dir (its nearest existing parent)
    stages: tuple[Stage, ...] = ()
    trainable_params: int | None = None
    memory_gb: tuple[tuple[str, float], ...] = ()  #: per training process, by part
    gpu_memory_gb: float | None = None
    #: (sequence length, GB per training process at each of PLAN_BATCHES) for PLAN_LENGTHS and
    #: data.max_length
    memory_by_length: tuple[tuple[int, tuple[float, ...]], ...] = ()
    #: bytes/s of shards one training node reads at the planned speed (plan.train_tokens_per_s x
    #: processes per node x bytes per token): what its disk or page cache must deliver
    read_bytes_per_s: float | None = None
    #: the shard folder's read rate measured by preflight's probe (bytes/s), and where
    disk_bytes_per_s: float | None = None
    disk_probe: str = ""

    @property
    def train_memory_gb(self) -> float | None:
        return sum(v for _, v in self.memory_gb) if self.memory_gb else None


# ----------------------------------------------------------------------------- tokens


def _length_policy(lengths: list[int], data: DataConfig) -> list[int]:
    if data.overlong == "drop":
        return [n for n in lengths if n <= data.max_length]
    return [min(n, data.max_length) for n in lengths]


def _record_tokens(r: Record, tokenizer, line_bytes: int | None = None) -> int:
    if r.tokens is not None:
        return len(r.tokens.input_ids)
    if tokenizer is not None:
        return len(render_chat(tokenizer, r.messages, add_generation_prompt=False))
    if line_bytes is None:
        line_bytes = len(json.dumps({"messages": r.messages}, ensure_ascii=False).encode())
    return math.ceil(line_bytes / BYTES_PER_TOKEN_TEXT)


def count_tokens(
    data: DataConfig,
    tokenizer=None,
    *,
    vocab_size: int | None = None,
    small_bytes: int = SMALL_DATA_BYTES,
) -> DataCount:
    """The training tokens in data.path, as prepare would plan them (exact when the file is small
    and the tokenizer is given, else estimated; `source` says which). Raises DataError for a bad
    line."""
    path = Path(data.path)
    if not path.is_file():
        raise DataError(f"{path}: data file not found")
    size = path.stat().st_size
    if size <= small_bytes:
        records, bad = load_records(
            path, vocab_size=vocab_size, bad_lines="skip"
        )  # all of them, named
        train = records[: len(records) - min(data.num_heldout, len(records) - 1)]
        lengths = _length_policy([_record_tokens(r, tokenizer) for r in train], data)
        convs = any(r.messages is not None for r in records)
        how = (
            "tokenized with the chat template"
            if tokenizer is not None and convs
            else f"conversations at {BYTES_PER_TOKEN_TEXT} B/token of JSON"
            if convs
            else "pre-tokenized"
        )
        return DataCount(
            len(lengths),
            sum(lengths),
            _turns(train),
            convs,
            f"{len(records)} records read, {how}",
            tuple(bad),
        )
    return _estimate_large(path, size, data, tokenizer)


def _turns(records: list[Record]) -> int:
    return sum(m["role"] == "assistant" for r in records if r.messages for m in r.messages)


def _estimate_large(path: Path, size: int, data: DataConfig, tokenizer) -> DataCount:
    sample, lines = [], 0
    with open(path, "rb") as f:
        for lineno, line in enumerate(f, start=1):
            if len(sample) == SAMPLE_LINES:
                break
            if line.strip():
                try:
                    raw = json.loads(line)
                except ValueError as e:
                    raise DataError(f"{path}:{lineno}: malformed JSON ({e})") from None
                tokens = (
                    raw.get("input_ids")
                    if isinstance(raw, dict) and "messages" not in raw
                    else None
                )
                rec = Record(f"{path}:{lineno}", messages=None if tokens else raw.get("messages"))
                n = len(tokens) if tokens else _record_tokens(rec, tokenizer, len(line))
                sample.append((len(line), n, rec))
        f.seek(0)
        for block in iter(lambda: f.read(1 << 24), b""):
            lines += block.count(b"\n")
    if not sample:
        raise DataError(f"{path}: no records in its first lines")
    lines = max(lines, len(sample))
    convs = any(rec.messages for _, _, rec in sample)
    raw_tokens = sum(n for _, n, _ in sample)
    kept = _length_policy([n for _, n, _ in sample], data)
    ratio = sum(b for b, _, _ in sample) / max(raw_tokens, 1)  # bytes per token in this file
    train_share = max(lines - data.num_heldout, 1) / lines
    tokens = int(size / ratio * sum(kept) / max(raw_tokens, 1) * train_share)
    sequences = int(lines * len(kept) / len(sample) * train_share)
    turns = int(_turns([rec for _, _, rec in sample]) / len(sample) * lines * train_share)
    how = (
        "rendered with the chat template"
        if tokenizer is not None or not convs
        else "at the documented ratio"
    )
    return DataCount(
        sequences,
        tokens,
        turns,
        convs,
        f"estimated: {size / 1e6:,.1f} MB, {lines:,} lines, "
        f"{ratio:.2f} B/token in its first {len(sample)} records ({how})",
    )


# ----------------------------------------------------------------------------- memory


def training_memory(
    dcfg,
    *,
    vocab_size: int,
    batch_size: int,
    seq_len: int,
    ttt_steps: int,
    bf16: bool,
    processes: int = 1,
    fsdp: bool = False,
    ema: bool = False,
) -> tuple[tuple[str, float], ...]:
    """GB per training process, by part (see the module docstring); `dcfg` an eyas DrafterConfig."""
    from eyas.training.losses import HEAD_CHUNK_ROWS, TEACHER_CHUNK_ROWS

    params = trainable_params(dcfg)
    H, e = dcfg.hidden_size, 2 if bf16 else 4
    states = (
        4 + (12 + 4 * ema) / processes if fsdp else 16 + 4 * ema
    ) * params  # fp32 weights, grads, m, v, EMA
    frozen = vocab_size * dcfg.target_hidden_size * (2 + e)  # embedding (bf16 on GPU) + target head
    chunks = TEACHER_CHUNK_ROWS * vocab_size * 4 + HEAD_CHUNK_ROWS * dcfg.draft_vocab_size * 4
    once = ((dcfg.num_aux + 1) * dcfg.target_hidden_size + dcfg.draft_vocab_size + H) * e
    attn = (
        dcfg.num_attention_heads * dcfg.head_dim * 2 + 2 * dcfg.num_key_value_heads * dcfg.head_dim
    )
    step = (7 * H + attn + 3 * dcfg.intermediate_size) * e  # 2H input, norms, q/k/v/out, MLP
    acts = batch_size * seq_len * (once + ttt_steps * step)
    return tuple(
        (k, round(v / GB, 3))
        for k, v in [
            ("weights+Adam", states),
            ("frozen embedding+head", frozen),
            ("chunks", chunks),
            ("activations", acts),
        ]
    )


def trainable_params(dcfg) -> int:
    """Trainable parameters: every float weight SGLang's drafter folder holds
    (eyas/evaluation/export.py)."""
    from eyas.evaluation.export import expected_weights

    return sum(
        math.prod(shape) for shape, fixed in expected_weights(dcfg).values() if fixed is None
    )


# ----------------------------------------------------------------------------- the plan


def processes(cfg: PipelineConfig) -> int:
    d = cfg.training.distributed
    return d.nproc_per_node * max(len(d.hosts), 1)


def on_gpu(cfg: PipelineConfig) -> bool:
    """Whether training runs on GPUs ("auto" is taken for yes when plan.gpu_memory_gb is set)."""
    return cfg.training.device != "cpu" and (
        cfg.training.device != "auto" or cfg.plan.gpu_memory_gb is not None
    )


def _byte_figures(cfg: PipelineConfig, tcfg: dict, count: DataCount | None) -> dict:
    """Bytes per token of the shards, a training node's reading rate, and the shards' total."""
    from eyas.extraction.dataset import HEADER_BYTES
    from eyas.extraction.shards import bytes_per_token

    x, t, p = cfg.extraction, cfg.training, cfg.plan
    bpt = bytes_per_token(int(tcfg["hidden_size"]), len(cfg.target.layer_ids), x.dtype, x.encoding)
    figures = {
        "bytes_per_token": bpt,
        "read_bytes_per_s": p.train_tokens_per_s * t.distributed.nproc_per_node * bpt,
    }
    if count is not None:
        headers = x.num_shards * HEADER_BYTES + 8 * (count.sequences + x.num_shards)  # + offsets
        figures["total_bytes"] = count.tokens * bpt + headers
    return figures


def _stages(cfg: PipelineConfig, count: DataCount) -> tuple[Stage, ...]:
    """Extract, regenerate (when enabled) and train, each with its tokens and rate."""
    x, t, p = cfg.extraction, cfg.training, cfg.plan
    servers, world = 1 + len(x.endpoints), processes(cfg)
    stages = [
        Stage(
            "extract",
            count.tokens,
            p.prefill_tokens_per_s * servers,
            f"{servers} server(s) at {p.prefill_tokens_per_s:,.0f} tokens/s",
        )
    ]
    if cfg.data.regenerate.enabled:
        made = count.assistant_turns * cfg.data.regenerate.max_new_tokens
        stages.append(
            Stage(
                "regenerate",
                made,
                p.decode_tokens_per_s * servers,
                f"{count.assistant_turns:,} turns x up to {cfg.data.regenerate.max_new_tokens} "
                f"new tokens at {p.decode_tokens_per_s:,.0f} tokens/s x {servers}",
            )
        )
    per_seq = count.tokens / max(count.sequences, 1)
    seqs = t.max_steps * t.batch_size * t.grad_accum * world
    stages.append(
        Stage(
            "train",
            int(seqs * per_seq),
            p.train_tokens_per_s * world,
            f"{t.max_steps:,} steps x {t.batch_size * t.grad_accum * world} sequences x "
            f"{per_seq:,.0f} tokens at {p.train_tokens_per_s:,.0f} tokens/s x {world} "
            f"process(es); {seqs / max(count.sequences, 1):.1f} epochs",
        )
    )
    return tuple(stages)


def _memory_figures(cfg: PipelineConfig, tcfg: dict, dcfg) -> dict:
    """Trainable parameters, one training process's memory at the configured batch and length, and
    its total at PLAN_LENGTHS x PLAN_BATCHES."""
    t = cfg.training

    def memory(batch_size: int, seq_len: int) -> tuple[tuple[str, float], ...]:
        return training_memory(
            dcfg,
            vocab_size=int(tcfg["vocab_size"]),
            batch_size=batch_size,
            seq_len=seq_len,
            ttt_steps=t.ttt_steps,
            bf16=on_gpu(cfg) and t.precision == "bf16",
            processes=processes(cfg),
            fsdp=t.distributed.strategy == "fsdp",
            ema=t.ema_decay > 0,
        )

    lengths = sorted({*PLAN_LENGTHS, cfg.data.max_length})
    return {
        "trainable_params": trainable_params(dcfg),
        "memory_gb": memory(t.batch_size, cfg.data.max_length),
        "memory_by_length": tuple(
            (n, tuple(round(sum(v for _, v in memory(b, n)), 1) for b in PLAN_BATCHES))
            for n in lengths
        ),
    }


def make_plan(
    cfg: PipelineConfig,
    tcfg: dict | None,
    count: DataCount | None,
    *,
    free_bytes: int | None = None,
    dcfg=None,
) -> Plan:
    """The plan from what could be read (tcfg None: no bytes; count None: no tokens; dcfg None: no
    memory)."""
    plan = {
        "num_shards": cfg.extraction.num_shards,
        "data": count,
        "free_bytes": free_bytes,
        "gpu_memory_gb": cfg.plan.gpu_memory_gb,
    }
    if tcfg is not None:
        plan.update(_byte_figures(cfg, tcfg, count))
    if count is not None:
        plan["stages"] = _stages(cfg, count)
    if dcfg is not None and tcfg is not None:
        plan.update(_memory_figures(cfg, tcfg, dcfg))
    return Plan(**plan)


def _shards_line(plan: Plan, cfg: PipelineConfig) -> str:
    per_shard = plan.total_bytes / plan.num_shards
    x = cfg.extraction
    return (
        f"  shards     {plan.num_shards} x {per_shard / GB:,.3f} GB = "
        f"{plan.total_bytes / GB:,.2f} GB "
        f"({plan.bytes_per_token:,} B/token: {len(cfg.target.layer_ids)} aux layers + "
        f"the last, {x.dtype} {x.encoding})"
    )


def _reading_line(plan: Plan, cfg: PipelineConfig) -> str:
    x, t = cfg.extraction, cfg.training
    disk = (
        f"; the shard folder reads {plan.disk_bytes_per_s / GB:,.2f} GB/s ({plan.disk_probe})"
        if plan.disk_bytes_per_s is not None
        else f"; {plan.disk_probe or 'the shard folder not probed'}"
    )
    return (
        f"  reading    {plan.read_bytes_per_s / GB:,.2f} GB/s of shards per training node "
        f"({t.distributed.nproc_per_node} process(es) x plan.train_tokens_per_s="
        f"{cfg.plan.train_tokens_per_s:g} x {plan.bytes_per_token:,} B/token, {x.dtype} "
        f"{x.encoding}){disk}"
    )


def _memory_line(plan: Plan, cfg: PipelineConfig) -> str:
    t = cfg.training
    parts = ", ".join(f"{k} {v:,.2f}" for k, v in plan.memory_gb)
    limit = (
        f"of plan.gpu_memory_gb={plan.gpu_memory_gb:g}"
        if plan.gpu_memory_gb
        else "(plan.gpu_memory_gb not set: not checked)"
    )
    return (
        f"  memory     {plan.train_memory_gb:,.1f} GB per training process {limit} at "
        f"training.batch_size="
        f"{t.batch_size} x data.max_length={cfg.data.max_length}, TTT {t.ttt_steps}: {parts} "
        f"({plan.trainable_params / 1e6:,.1f} M trainable parameters)"
    )


def _by_length_line(plan: Plan) -> str:
    """The memory table; "!" marks a total over plan.gpu_memory_gb less the estimate's error."""
    limit = plan.gpu_memory_gb

    def gb(v: float) -> str:
        return f"{v:,.1f}" + ("!" if limit and v > limit * (1 - MEMORY_MARGIN) else "")

    rows = "; ".join(f"{n:,}: {'/'.join(gb(v) for v in row)}" for n, row in plan.memory_by_length)
    over = (
        f" (! = more than plan.gpu_memory_gb={limit:g} less the estimate's "
        f"{MEMORY_MARGIN:.0%} error)"
        if limit
        else ""
    )
    return (
        f"  by length  GB per training process at batch {'/'.join(map(str, PLAN_BATCHES))} "
        f"by data.max_length: {rows}{over}"
    )


def plan_lines(plan: Plan, cfg: PipelineConfig) -> list[str]:
    """The plan as the lines `eyas preflight` prints."""
    out, c = [], plan.data
    out.append(
        f"  data       {c.sequences:,} sequences, {c.tokens:,} tokens ({c.source})"
        if c
        else "  data       unknown (see the problems)"
    )
    if plan.total_bytes is not None:
        out.append(_shards_line(plan, cfg))
    if plan.free_bytes is not None:
        out.append(
            f"  disk       {plan.free_bytes / GB:,.2f} GB free at extraction.output_dir, "
            f"extraction.keep_free_gb={cfg.extraction.keep_free_gb} kept free"
        )
    for s in plan.stages:
        out.append(f"  {s.name:<10} {s.hours:,.2f} h: {s.tokens:,} tokens ({s.detail})")
    if plan.stages:
        out.append(
            f"  total      {sum(s.hours for s in plan.stages):,.2f} h (stages only: no loading, "
            f"export, evaluation or serving benchmark)"
        )
    if plan.read_bytes_per_s is not None:
        out.append(_reading_line(plan, cfg))
    if plan.memory_gb:
        out.append(_memory_line(plan, cfg))
    if plan.memory_by_length:
        out.append(_by_length_line(plan))
    return out
