"""The local server's model side: load a Hugging Face checkpoint shard by shard, run requests.

    model = load_model("fixtures/tiny-target", load_delay=0.0)     # prints SGLang's loading bar
    engine = Engine(model, tokenizer, chunk_size=128, writer=DumpWriter(...), capture_ids=[2, 4, 5])
    engine.generate(input_ids, rid, params)

Prefill runs in chunks through the KV cache, as SGLang's chunked prefill does, and every chunk's
hidden states go through eyas.dump before the request returns. The HTTP side is
eyas/local/server.py.

With a drafter (`Engine(..., speculative=Speculative.load(dir, target_path, num_steps=3))`),
greedy requests are decoded by greedy chain speculative decoding
(eyas.evaluation.evaluate.speculative_greedy) and report SGLang's counter `spec_verify_ct`;
acceptance length = completion tokens / verify steps.

With `think_tokens=N` (eyas serve-local --think-tokens N) it plays a thinking model: a reply that
starts inside the <think> the chat template opened reasons for N tokens, then closes it with
</think> and answers (eyas.local.batch.Think); meta_info carries `reasoning_tokens`, as SGLang's
does with a reasoning parser.
"""

from __future__ import annotations

import json
import re
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file
from tqdm import tqdm

from eyas.dump import DumpWriter
from eyas.errors import EyasError, InvalidInput
from eyas.layers import captured_layer_ids, eagle_config_capture_ids
from eyas.local.batch import DecodeBatch, Sequence, Think

# SGLang's exact loading bar (utils/common.py) and its default description (multithread loader).
BAR_FORMAT = (
    "{desc}: {percentage:3.0f}% Completed | {n_fmt}/{total_fmt} [{elapsed}<{remaining}, {rate_fmt}]"
)
BAR_DESC = "Multi-thread loading shards"
FAULTS = ("none", "die-at-shard", "hang-at-shard", "oom-at-shard")


# What a data-parallel replica's lines carry after their time, as SGLang's scheduler lines do
# (" DP1 TP0"): the readiness sensor tells the replicas' loads apart by it. One server: nothing.
_rank = ""


def set_dp_rank(rank: int | None) -> None:
    """Mark every later log line of this process as replica `rank`'s (None: one replica)."""
    global _rank
    _rank = "" if rank is None else f" DP{rank} TP0"


def log(msg: str) -> None:
    """One SGLang-format log line, flushed at once (the readiness sensor tails this file)."""
    sys.stderr.write(f"[{time.strftime('%Y-%m-%d %H:%M:%S')}{_rank}] {msg}\n")
    sys.stderr.flush()


def _avail_mem_gb() -> float:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) / 2**20
    except OSError:
        pass
    return 0.0


# ---------------------------------------------------------------------------------------------
# Loading, shard by shard
# ---------------------------------------------------------------------------------------------


def shard_files(model_path: str | Path) -> list[Path]:
    """The checkpoint's safetensors files, in the order the index lists them."""
    model_path = Path(model_path)
    index = model_path / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        return [model_path / name for name in dict.fromkeys(sorted(weight_map.values()))]
    single = model_path / "model.safetensors"
    if single.exists():
        return [single]
    raise FileNotFoundError(f"{model_path}: no model.safetensors.index.json or model.safetensors")


_EXPERT_KEY = re.compile(r"^(.*\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


def fuse_experts(state: dict[str, torch.Tensor], expected: set[str]) -> dict[str, torch.Tensor]:
    """Checkpoints store MoE experts one by one; transformers 5 modules hold them fused.

    experts.{e}.gate_proj/up_proj -> experts.gate_up_proj [E, 2I, H] (gate rows first), and
    experts.{e}.down_proj -> experts.down_proj [E, H, I]; the same layout transformers' own
    conversion mapping produces. A no-op for models that keep per-expert modules.
    """
    groups: dict[str, dict[str, dict[int, torch.Tensor]]] = {}
    out = {}
    for key, value in state.items():
        m = _EXPERT_KEY.match(key)
        if m and f"{m[1]}.down_proj" in expected:
            groups.setdefault(m[1], {}).setdefault(m[3], {})[int(m[2])] = value
        else:
            out[key] = value
    for prefix, parts in groups.items():

        def stacked(name: str, parts=parts) -> torch.Tensor:
            return torch.stack([parts[name][e] for e in sorted(parts[name])])

        out[f"{prefix}.gate_up_proj"] = torch.cat([stacked("gate_proj"), stacked("up_proj")], dim=1)
        out[f"{prefix}.down_proj"] = stacked("down_proj")
    return out


def _inject_fault(fault: str, shard: int, num_shards: int, path: Path) -> None:
    where = f"after {shard} of {num_shards} shards (at {path.name})"
    if fault == "hang-at-shard":
        while True:  # stop progressing, like a loader stuck on a dead NFS mount
            time.sleep(3600)
    if fault == "die-at-shard":
        # Uncaught: Python prints the traceback and exits with status 1.
        raise RuntimeError(f"eyas fault injection: died {where}")
    if fault == "oom-at-shard":
        try:
            raise torch.OutOfMemoryError(
                "CUDA out of memory. Tried to allocate 1.75 GiB. GPU 0 has a total capacity of "
                "79.19 GiB of which 1.02 GiB is free. Including non-PyTorch memory, this process "
                "has 78.16 GiB memory in use. Of the allocated memory 76.90 GiB is allocated by "
                "PyTorch, and 512.00 MiB is reserved by PyTorch but unallocated. If reserved but "
                "unallocated "
                "memory is large try setting PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to "
                "avoid fragmentation.  See documentation for Memory Management  "
                "(https://pytorch.org/docs/stable/notes/cuda.html#environment-variables)"
            )
        except torch.OutOfMemoryError:
            log(f"Scheduler hit an exception: {traceback.format_exc()}")
        log("Received sigquit from a child process. It usually means the child failed.")
        sys.exit(1)


def _read_shards(
    files: list[Path], load_delay: float, fault: str, fault_shard: int
) -> dict[str, torch.Tensor]:
    """Every shard's tensors, one shard at a time under SGLang's bar; the fault injected at its
    shard."""
    # mininterval=0: print every shard, as SGLang's bar does for its few, slow shards.
    bar = tqdm(
        total=len(files),
        desc=BAR_DESC,
        bar_format=BAR_FORMAT,
        file=sys.stderr,
        mininterval=0,
        miniters=1,
    )
    state: dict[str, torch.Tensor] = {}
    for k, path in enumerate(files):
        if fault != "none" and k == fault_shard:
            _inject_fault(fault, k, len(files), path)
        state.update(load_file(str(path)))
        if load_delay:
            time.sleep(load_delay)
        bar.update(1)
    if fault != "none" and fault_shard == len(files):
        _inject_fault(fault, fault_shard, len(files), files[-1])  # after N/N, like sglang#9917
    bar.close()
    return state


def _build_model(model_path: Path, state: dict[str, torch.Tensor]) -> torch.nn.Module:
    """The model from config.json, filled with the checkpoint's weights (experts fused)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(
        model_path, trust_remote_code=False
    )  # local backend: no remote code
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    result = model.load_state_dict(fuse_experts(state, set(model.state_dict())), strict=False)
    if result.missing_keys:
        raise InvalidInput(
            f"{model_path}: checkpoint lacks {len(result.missing_keys)} weights, "
            f"e.g. {result.missing_keys[:5]}"
        )
    if result.unexpected_keys:  # e.g. DeepSeek's MTP layer, which SGLang also skips here
        log(
            f"Ignored {len(result.unexpected_keys)} checkpoint weights the model does not use, "
            f"e.g. {result.unexpected_keys[:3]}"
        )
    if (model_path / "generation_config.json").exists():
        from transformers import GenerationConfig

        # SGLang stops at config.json's eos and generation_config.json's (model_config.py,
        # _get_hf_eos_token_id): chat models list their end-of-turn token there.
        model.generation_config = GenerationConfig.from_pretrained(model_path)
    return model


def load_model(
    model_path: str | Path, *, load_delay: float = 0.0, fault: str = "none", fault_shard: int = 0
) -> torch.nn.Module:
    """Read the checkpoint shard by shard (printing SGLang's bar), then build the model from
    config.json and fill it. transformers is imported only after the shards are read: it takes
    seconds to import, and a fault-injected load should fail as early as a real one would."""
    model_path = Path(model_path)
    if not (model_path / "config.json").exists():
        raise FileNotFoundError(f"{model_path}: no config.json")
    files = shard_files(model_path)
    if fault != "none" and not 0 <= fault_shard <= len(files):
        raise InvalidInput(
            f"--fault-shard {fault_shard} out of range: the checkpoint has {len(files)} shards"
        )
    log(f"Load weight begin. avail mem={_avail_mem_gb():.2f} GB")
    tic = time.monotonic()
    state = _read_shards(files, load_delay, fault, fault_shard)
    model = _build_model(model_path, state)
    from eyas.local.mla import absorb_mla  # imports transformers, as _build_model has

    if absorb_mla(model):
        log("MLA: absorbed where keys are cached (later prefill chunks, decode, verify)")
    model.eval()
    log(
        f"Load weight end. elapsed={time.monotonic() - tic:.2f} s, type={type(model).__name__}, "
        f"dtype=torch.float32, avail mem={_avail_mem_gb():.2f} GB, mem usage="
        f"{sum(t.numel() * t.element_size() for t in state.values()) / 2**30:.2f} GB."
    )
    return model


def optional_tokenizer(model_path: str | Path):
    """The tokenizer in the model folder, or None if it has no tokenizer.json (text is then "")."""
    if not (Path(model_path) / "tokenizer.json").exists():
        log(f"No tokenizer.json in {model_path}: responses will have empty text")
        return None
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    try:
        return AutoTokenizer.from_pretrained(
            str(model_path), trust_remote_code=False
        )  # local backend: off
    except (OSError, ValueError, KeyError) as e:  # a bare tokenizer.json without tokenizer_config
        log(f"AutoTokenizer failed ({type(e).__name__}: {e}); using tokenizer.json directly")
        return PreTrainedTokenizerFast(tokenizer_file=str(Path(model_path) / "tokenizer.json"))


def resolve_capture_ids(ids: list[int] | None, num_layers: int) -> list[int]:
    """SGLang's set_eagle3_layers_to_capture: default [2, L//2, L-3]; a list starting at 1 is +1."""
    if ids is None:
        return [2, num_layers // 2, num_layers - 3]
    # DeepSeek-V2's rule: the DeepSeek-V3 served here is of that family
    shifted = captured_layer_ids(ids)
    if shifted != ids:
        log(
            f"Aux layer ids {ids} start at 1: read as output-of ids (as SGLang does), capturing "
            f"{shifted}"
        )
    ids = shifted
    if max(ids) >= num_layers:
        # HF hidden_states[L] is the post-norm output, which SGLang cannot capture either.
        raise InvalidInput(
            f"aux layer id {max(ids)} out of range: the model has {num_layers} layers, "
            f"so capture ids go up to {num_layers - 1}"
        )
    return sorted(ids)


# ---------------------------------------------------------------------------------------------
# The engine: chunked prefill with a KV cache, then greedy or sampled decode
# ---------------------------------------------------------------------------------------------


def _think_ids(tokenizer, vocab_size: int) -> tuple[int, int]:
    """The ids of <think> and </think>: one token each, inside the model's vocabulary."""
    if tokenizer is None:
        raise InvalidInput(
            "--think-tokens needs the model folder's tokenizer (to find <think> and </think>)"
        )
    ids = []
    for tag in ("<think>", "</think>"):
        encoded = tokenizer.encode(tag, add_special_tokens=False)
        if len(encoded) != 1 or not 0 <= encoded[0] < vocab_size:
            raise InvalidInput(
                f"--think-tokens: the tokenizer spells {tag} as {encoded}, not one token id below "
                f"the vocabulary size {vocab_size}"
            )
        ids.append(int(encoded[0]))
    return ids[0], ids[1]


class BadRequest(EyasError, ValueError):
    """A /generate request that cannot be served; answered with 400 and this message."""


class Speculative:
    """An exported EAGLE-3 drafter (its SGLang-format folder) and the chain length to draft."""

    def __init__(self, drafter: torch.nn.Module, capture_ids: list[int], num_steps: int, path: str):
        self.drafter, self.capture_ids, self.num_steps, self.path = (
            drafter,
            capture_ids,
            num_steps,
            path,
        )

    @classmethod
    def load(
        cls,
        drafter_dir: str | Path,
        target_path: str | Path,
        *,
        num_steps: int,
        num_target_layers: int,
    ) -> "Speculative":
        from eyas.evaluation.export import load_exported

        drafter, _, meta = load_exported(drafter_dir, target_checkpoint=target_path)
        ids = list(meta["eagle_config"]["eagle_aux_hidden_state_layer_ids"])
        ids = eagle_config_capture_ids(ids)
        if max(ids) >= num_target_layers:
            raise InvalidInput(
                f"{drafter_dir}: the drafter reads layers {ids}, the target has only "
                f"{num_target_layers}"
            )
        log(
            f"Loaded EAGLE3 draft model from {drafter_dir}: aux layers {ids}, {num_steps} steps, "
            f"topk 1"
        )
        return cls(drafter, ids, num_steps, str(drafter_dir))


class Engine:
    def __init__(
        self,
        model: torch.nn.Module,
        tokenizer,
        *,
        chunk_size: int,
        writer: DumpWriter | None,
        capture_ids: list[int],
        seed: int = 0,
        speculative: Speculative | None = None,
        max_running: int = 1,
        think_tokens: int = 0,
    ):
        self.model = model
        self.speculative = speculative
        # Totals since start, as SGLang's scheduler keeps them (for /server_info).
        self.num_completion_tokens = self.num_verify_steps = 0
        self.tokenizer = tokenizer
        self.chunk_size = chunk_size  # -1: the whole prompt in one forward
        self.writer = writer
        self.capture_ids = capture_ids
        self.lock = threading.Lock()  # one forward at a time through the model
        # max_running > 1: plain decode steps of concurrent requests share one forward
        # (eyas/local/batch.py)
        self.batch = DecodeBatch(model, self.lock, max_running) if max_running > 1 else None
        self.generator = torch.Generator().manual_seed(seed)
        cfg = model.config
        self.vocab_size = cfg.vocab_size
        self.context_len = getattr(cfg, "max_position_embeddings", None) or 1 << 30
        eos = []
        for source in (cfg, getattr(model, "generation_config", None)):  # as SGLang, both
            ids = getattr(source, "eos_token_id", None)
            eos += ids if isinstance(ids, list) else [ids]
        if tokenizer is not None and tokenizer.eos_token_id is not None:
            eos.append(tokenizer.eos_token_id)
        self.eos_ids = {int(i) for i in eos if i is not None}
        self.think_tokens, self.think_ids = think_tokens, None
        if think_tokens < 0:
            raise InvalidInput(f"--think-tokens must be >= 0 (0: off), got {think_tokens}")
        if think_tokens:
            self.think_ids = _think_ids(tokenizer, self.vocab_size)
            if speculative is not None:
                raise InvalidInput(
                    "--think-tokens with --speculative-draft-model-path: eyas-local "
                    "plays a thinking model in plain decoding only"
                )
            log(
                f"Thinking model: replies inside <think> reason for {think_tokens} tokens, then "
                f"</think> (ids {self.think_ids})"
            )

    @torch.no_grad()
    def prefill(self, ids: list[int], rid: str):
        """Run the prompt in chunks through the KV cache; dump each chunk. Returns (logits,
        cache)."""
        dump = self.writer is not None and not self.writer.should_skip(rid)
        step = len(ids) if self.chunk_size == -1 else self.chunk_size
        cache = None
        for start in range(0, len(ids), step):
            chunk = torch.tensor([ids[start : start + step]])
            out = self.model(
                input_ids=chunk, past_key_values=cache, use_cache=True, output_hidden_states=dump
            )
            cache = out.past_key_values
            if dump:
                hs = (
                    out.hidden_states
                )  # L+1 entries: inputs of layers 0..L-1, then post-norm output
                aux = torch.cat([hs[i][0] for i in self.capture_ids], dim=-1)
                self.writer.write(rid, start, chunk[0], aux, hs[-1][0])
        return out.logits[0, -1], cache

    def _plain(
        self, ids, rid, max_new, temperature, stop_ids, generator, think
    ) -> tuple[list[int], dict]:
        """(output, finish) of plain decoding: in the decode batch shared with concurrent requests
        where there is one, else alone."""
        if self.batch is not None and max_new > 0:
            with self.lock:
                logits, cache = self.prefill(ids, rid)
            return self.batch.decode(
                Sequence(
                    logits,
                    cache,
                    len(ids),
                    max_new,
                    temperature,
                    stop_ids,
                    generator,
                    think=think,
                )
            )
        with self.lock:
            return self._decode(ids, rid, max_new, temperature, stop_ids, generator, think)

    @torch.no_grad()
    def generate(self, ids: list[int], rid: str, params: dict[str, Any]) -> dict[str, Any]:
        tic = time.monotonic()
        if len(ids) >= self.context_len:
            raise BadRequest(
                f"rid {rid}: the input ({len(ids)} tokens) is longer than the model's "
                f"context length ({self.context_len} tokens)"
            )
        max_new = min(params["max_new_tokens"], self.context_len - len(ids))
        temperature = params["temperature"]
        stop_ids = set() if params["ignore_eos"] else self.eos_ids
        stop_ids = stop_ids | set(params["stop_token_ids"])
        generator = self.generator
        if params["sampling_seed"] is not None:
            generator = torch.Generator().manual_seed(params["sampling_seed"])

        think = Think.plan(ids, *self.think_ids, self.think_tokens) if self.think_ids else None
        if self.speculative is not None and temperature == 0 and max_new > 0:
            with self.lock:
                output, verify_steps = self._speculative(ids, max_new, stop_ids)
            finish = (
                {"type": "stop", "matched": output[-1]}
                if output[-1] in stop_ids
                else {"type": "length", "length": max_new}
            )
        else:
            output, finish = self._plain(ids, rid, max_new, temperature, stop_ids, generator, think)
            verify_steps = max(len(output) - 1, 0)  # one target forward per token after the first
        with self.lock:
            self.num_completion_tokens += len(output)
            self.num_verify_steps += verify_steps

        text = ""
        if self.tokenizer is not None:
            text = self.tokenizer.decode(output, skip_special_tokens=params["skip_special_tokens"])
        meta = {
            "id": rid,
            "finish_reason": finish,
            "prompt_tokens": len(ids),
            "completion_tokens": len(output),
            "cached_tokens": 0,
            "e2e_latency": time.monotonic() - tic,
        }
        if self.speculative is not None:
            meta["spec_verify_ct"] = verify_steps
        if self.think_ids is not None:  # SGLang's figure with a reasoning parser: the span's tokens
            meta["reasoning_tokens"] = think.count if think is not None else 0
        return {"text": text, "output_ids": output, "meta_info": meta}

    def _speculative(
        self, ids: list[int], max_new: int, stop_ids: set[int]
    ) -> tuple[list[int], int]:
        from eyas.evaluation.evaluate import speculative_greedy

        spec = self.speculative
        return speculative_greedy(
            self.model, spec.drafter, ids, spec.capture_ids, spec.num_steps, max_new, stop_ids
        )

    def avg_spec_accept_length(self) -> float | None:
        """Completion tokens / verify steps since start (SGLang's internal_states figure)."""
        if self.speculative is None or self.num_verify_steps == 0:
            return None
        return self.num_completion_tokens / self.num_verify_steps

    @torch.no_grad()
    def _decode(
        self, ids, rid, max_new, temperature, stop_ids, generator, think=None
    ) -> tuple[list[int], dict]:
        """Plain decoding: chunked prefill (dumped), then one target forward per token."""
        logits, cache = self.prefill(ids, rid)
        if max_new == 0:
            return [], {"type": "length", "length": 0}
        seq = Sequence(
            logits, cache, len(ids), max_new, temperature, stop_ids, generator, think=think
        )
        while not seq.take(logits):  # no forward for a token we will not emit
            out = self.model(
                input_ids=torch.tensor([seq.output[-1:]]), past_key_values=cache, use_cache=True
            )
            logits, cache = out.logits[0, -1], out.past_key_values
        return seq.output, seq.finish
