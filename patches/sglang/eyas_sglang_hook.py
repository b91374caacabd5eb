"""eyas's SGLang forward hook: write every prefill chunk's hidden states as eyas dump records.

Installed by the patch stage (eyas/server/sglang_patch.py) as a top-level module in the server's
site-packages, beside `eyas_dump.py` (a byte copy of eyas/dump.py, the one dump writer); one module
for every SGLang version that has a patch set. SGLang registers it on the logits processor, after
CUDA graph capture. On SGLang 0.5.23, in capture-only mode:

    python -m sglang.launch_server ... --enable-return-aux-hidden-states \
        --speculative-algorithm EAGLE3 --return-aux-hidden-state-layer-ids 2 30 58 \
        --disable-radix-cache --disable-prefill-cuda-graph --chunked-prefill-size 8192 \
        --forward-hooks '[{"name": "eyas-dump", "target_modules": ["*logits_processor"],
                           "hook_factory": "eyas_sglang_hook:make_hook",
                           "config": {"dump_dir": "/dev/shm/eyas-dump", "layer_ids": [2, 30, 58]}}]'

`hook_manager.register_forward_hooks` calls `make_hook(config)` and registers the result with
`module.register_forward_hook`, so the hook gets `(module, args, output)` with
`args = (input_ids, hidden_states, lm_head, forward_batch, aux_hidden_states)` and a
`LogitsProcessorOutput` whose `hidden_states` is the packed aux capture `[T, K*H]` and
`last_hidden_states` the final post-norm hidden state `[T, H]` (full capture mode, which
`--enable-return-aux-hidden-states` makes the server default).

`args[0]` is None on the multimodal path: KimiK25ForConditionalGeneration.forward reaches its
DeepseekV3ForCausalLM through managers/mm_utils.py:general_mm_embed_routine, which calls it with
`input_ids=None` and the embeddings (also for text-only requests), and DeepseekV2ForCausalLM.forward
hands that None on to the logits processor (module `language_model.logits_processor`). The token
ids are then read from `forward_batch.input_ids`, the tensor the model runner passed to the
wrapper. A forward that carried image/video/audio inputs is not dumped: mm_utils.embed_mm_inputs
has replaced those rows' ids by clamped pad values in that same tensor.

SGLang 0.5.18 has no capture-only mode (no --enable-return-aux-hidden-states, no
`last_hidden_states` in LogitsProcessorOutput, no `aux_hidden_state_capture` feature): its target
captures aux hidden states only for a loaded EAGLE3 draft. eyas's capture launch there loads a stub
draft whose `eagle_config.eagle_aux_hidden_state_layer_ids` names the capture layers
(eyas/server/capture_draft.py); the target's extend forwards then run in full capture mode, the
packed aux states are the output's `hidden_states`, and the last (post-norm) hidden states are the
logits processor's own input, args[1]. The draft model's logits processor matches
`*logits_processor` too; its model config names an EAGLE draft (`is_draft_model`), and it is
passed over.

Config keys: `dump_dir` (default $EYAS_DUMP_DIR), `layer_ids` (capture-before ids the model
captures; default: derived from --return-aux-hidden-state-layer-ids), `rid_prefix` (default
"eyas-": only the collector's rids are dumped, so SGLang's warmup, whose rid is a random uuid,
is not), `dtype` (default $EYAS_DUMP_DTYPE or bfloat16), `max_pending` (default 4: chunks queued
for the background writer; 0 writes inside the forward), `architecture` (the target's model class:
which rule maps --return-aux-hidden-state-layer-ids to captured layers; default DeepSeek-V2's).

A forward without both aux and last hidden states (on 0.5.23 a server without capture-only mode,
such as an EAGLE3 speculative launch's target) is not dumped and never fails; a hook registered
through --forward-hooks in a 0.5.23 server without capture-only mode fails at registration instead,
naming the missing flag.

Imports only stdlib, torch and eyas_dump (torch + safetensors): it runs in SGLang's python.
"""

from __future__ import annotations

import atexit
import logging
import os
import queue
import threading
import time
from collections import OrderedDict
from typing import Any

import torch

import eyas_dump as dump

logger = logging.getLogger("eyas_sglang_hook")

CONFIG_KEYS = ("dump_dir", "layer_ids", "rid_prefix", "dtype", "max_pending", "architecture")
_MAX_TRACKED_RIDS = 65536  # rids whose prefill finished, to tell later decode rows apart

# Set when a hook registered through --forward-hooks first runs, so that the patched
# deepseek_v2.py (deepseek_v2.patch) does not write the same records a second time.
_forward_hook_active = False


class HookError(RuntimeError):
    """The server is not set up the way the hook needs; the message names the flag or key."""


def forward_hook_active() -> bool:
    """True once a hook made by SGLang's --forward-hooks has run in this process."""
    return _forward_hook_active


# ---------------------------------------------------------------------------------------------
# Layer ids and ranks, from SGLang's runtime context (0.5.23: sglang.srt.runtime_context)
# ---------------------------------------------------------------------------------------------

def captured_layer_ids(server_ids: list[int], architecture: str | None = None) -> list[int]:
    """The layers the target's model class captures for --return-aux-hidden-state-layer-ids.

    Mirrors set_eagle3_layers_to_capture: DeepseekV2ForCausalLM reads a list starting with 1 as
    "output of layer" ids and shifts it by +1 (any other list is capture-before); LlamaForCausalLM
    always shifts by +1 (eyas_dump.captured_layer_ids).
    """
    return dump.captured_layer_ids(server_ids, architecture)


_ABSENT = object()  # a feature this SGLang version does not have


def _capture_features() -> Any | None:
    """SGLang's resolved exec features (None outside SGLang)."""
    try:
        from sglang.srt.runtime_context import get_exec
    except ImportError:
        return None
    return get_exec().features


def _capture_only_mode(features: Any) -> Any:
    """features.aux_hidden_state_capture: None when capture-only mode is off, _ABSENT on an SGLang
    without that mode (0.5.18), where only an EAGLE3 draft makes the target capture."""
    return getattr(features, "aux_hidden_state_capture", _ABSENT)


def _server_layer_ids() -> list[int] | None:
    """--return-aux-hidden-state-layer-ids as the running server resolved it.

    None outside SGLang, when the ids were not given, or when capture-only mode is off.
    """
    features = _capture_features()
    if features is None:
        return None
    ids = getattr(features, "return_aux_hidden_state_layer_ids", None)
    if _capture_only_mode(features) in (None, _ABSENT) or ids is None:
        return None
    return [int(i) for i in ids]


def resolve_layer_ids(config_ids: list[int] | None, server_ids: list[int] | None,
                      architecture: str | None = None) -> list[int]:
    """The capture-before ids to record: the config's, checked against what the server captures."""
    captured = captured_layer_ids(server_ids, architecture) if server_ids is not None else None
    if config_ids is None:
        if captured is None:
            raise HookError("eyas hook: no layer ids; set config.layer_ids or launch with "
                            "--return-aux-hidden-state-layer-ids")
        return captured
    config_ids = [int(i) for i in config_ids]
    if captured is not None and captured != config_ids:
        raise HookError(f"eyas hook: config.layer_ids={config_ids}, but SGLang's "
                        f"{architecture or 'DeepSeek-V2 rule'} captures {captured} (from "
                        f"--return-aux-hidden-state-layer-ids {server_ids}: eyas_dump.server_layer_ids "
                        f"gives the ids to ask for)")
    return config_ids


def writes_here(parallel: Any) -> bool:
    """True on the rank that writes: attention-TP rank 0 (and attention-CP rank 0) of its group.

    Under plain TP the captured rows are replicated on every rank, so TP rank 0 writes (without
    DP attention attn_tp_rank == tp_rank). With --enable-dp-attention each attention-DP group runs
    its own requests, and attn_tp_rank 0 of every group writes.
    """
    return parallel.attn_tp_rank == 0 and parallel.attn_cp_rank == 0


_DRAFT_NAMES = ("Eagle", "NextN", "MTP")


def is_draft_model(logits_processor: Any) -> bool:
    """True for the logits processor of a speculative draft model (SGLang's LogitsProcessor keeps its
    model's config): an EAGLE draft's config has eagle_config or an Eagle/NextN/MTP architecture.
    A capture launch on SGLang 0.5.18 loads such a draft beside the target."""
    config = getattr(logits_processor, "config", None)
    if config is None:
        return False
    names = getattr(config, "architectures", None) or []
    return getattr(config, "eagle_config", None) is not None or any(
        marker in str(name) for name in names for marker in _DRAFT_NAMES)


def _runtime_parallel() -> Any | None:
    try:
        from sglang.srt.runtime_context import get_parallel
    except ImportError:
        return None
    return get_parallel()


def _torch_writes_here() -> bool:
    """Outside SGLang's runtime context: global rank 0 writes (or the only process)."""
    import torch.distributed as dist

    return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0


# ---------------------------------------------------------------------------------------------
# The hook
# ---------------------------------------------------------------------------------------------

class DumpHook:
    """A forward hook on the logits processor that dumps the extend rows of each forward."""

    def __init__(self, writer: dump.DumpWriter, *, parallel: Any = None, max_pending: int = 4,
                 via_forward_hooks: bool = True):
        self.writer = writer
        self._parallel = parallel
        self._writes: bool | None = None  # resolved at the first extend forward
        self._via_forward_hooks = via_forward_hooks
        self._prefilled: OrderedDict[str, None] = OrderedDict()
        self._checked = False
        self._told_no_states = False
        self._error: BaseException | None = None
        self._queue: queue.Queue | None = None
        if max_pending > 0:
            self._queue = queue.Queue(maxsize=max_pending)
            threading.Thread(target=self._drain, name="eyas-dump-writer", daemon=True).start()
            atexit.register(self._wait, 30.0)  # at shutdown: finish queued writes, raise nothing

    # -- called by torch after LogitsProcessor.forward -------------------------------------------
    def __call__(self, module, args, output) -> None:
        global _forward_hook_active
        if self._via_forward_hooks:
            _forward_hook_active = True
        if self._error is not None:
            raise HookError(f"eyas hook: the dump writer failed: {self._error!r}") from self._error
        if len(args) < 4:
            raise HookError(f"eyas hook: the logits processor got {len(args)} positional arguments; "
                            f"the hook needs (input_ids, hidden_states, lm_head, forward_batch, ...) "
                            f"positionally (a forward hook does not see keyword arguments)")
        if is_draft_model(module):
            return None  # `*logits_processor` matches a loaded EAGLE/NextN draft's processor too
        forward_batch = args[3]
        mode = forward_batch.forward_mode
        if not mode.is_extend() or mode.is_target_verify():
            return None  # decode / idle / verify forwards hold no prefill rows
        if output.next_token_logits is None:
            return None  # an autotune dummy run or a scoring path: not a real prefill
        aux, last = output.hidden_states, self._last_hidden_states(args, output)
        if last is _ABSENT:
            return None  # SGLang 0.5.18: a logits processor handed no aux states captures nothing
        if aux is None or last is None:
            # No capture-only mode: an EAGLE3 speculative launch's target captures aux states for
            # its draft but keeps no last states (LogitsProcessor._get_last_hidden_states_to_store),
            # and its first prefill is SGLang's own warm-up. Nothing to dump; never a reason to fail.
            self._tell_no_states()
            return None
        if aux.shape[0] != last.shape[0]:
            self._tell_no_states()  # capture of the last rows only: not a full prefill capture
            return None
        self._check_capture(aux, last)
        if self._writes is None:
            self._writes = self._resolve_writes_here()
        if not self._writes:
            return None
        rows = self._select_rows(forward_batch)
        if not rows:
            return None
        if getattr(forward_batch, "mm_input_embeds", None) is not None:
            # prepare_mm_inputs sets mm_input_embeds only for a batch with multimodal items; their
            # rows hold pad values (clamped in place), not token ids. eyas extracts text only.
            logger.error("eyas hook: not dumping %s: the forward carried multimodal inputs, whose "
                         "rows hold no token ids", sorted({rid for rid, *_ in rows}))
            return None
        self._dump(rows, self._input_ids(args[0], forward_batch), aux, last)
        return None

    @staticmethod
    def _last_hidden_states(args: tuple, output) -> torch.Tensor | None | object:
        """The forward's final post-norm hidden states: SGLang 0.5.23's output.last_hidden_states;
        on 0.5.18 the logits processor's hidden_states argument, when it was handed aux states
        (_ABSENT when it was not: that processor captures nothing)."""
        if hasattr(output, "last_hidden_states"):
            return output.last_hidden_states
        return args[1] if len(args) > 4 and args[4] is not None else _ABSENT

    @staticmethod
    def _input_ids(positional: torch.Tensor | None, forward_batch) -> torch.Tensor:
        """The forward's token ids: the logits processor's input_ids, or the batch's when None.

        A multimodal wrapper (KimiK25ForConditionalGeneration via general_mm_embed_routine) runs
        its language model with input_ids=None; forward_batch.input_ids is what the runner passed.
        """
        ids = positional if positional is not None else forward_batch.input_ids
        if ids is None:
            raise HookError("eyas hook: neither the logits processor's input_ids nor "
                            "forward_batch.input_ids is set; cannot tell the token ids")
        return ids

    def _tell_no_states(self) -> None:
        if not self._told_no_states:
            self._told_no_states = True
            logger.warning("eyas hook: this server keeps no aux and last hidden states together (no "
                           "--enable-return-aux-hidden-states): nothing is dumped")

    def _check_capture(self, aux: torch.Tensor, last: torch.Tensor) -> None:
        if self._checked:
            return
        k, hidden = len(self.writer.layer_ids), last.shape[-1]
        if aux.shape[-1] != k * hidden:
            raise HookError(f"eyas hook: aux hidden states are {aux.shape[-1]} wide, expected "
                            f"{k} layers x {hidden} = {k * hidden} for layer_ids "
                            f"{self.writer.layer_ids}")
        self._checked = True

    def _resolve_writes_here(self) -> bool:
        parallel = self._parallel if self._parallel is not None else _runtime_parallel()
        return writes_here(parallel) if parallel is not None else _torch_writes_here()

    def _select_rows(self, fb) -> list[tuple[str, int, int, int]]:
        """(rid, start row, num rows, prefix offset) of each prefill row worth dumping."""
        candidates = [i for i, rid in enumerate(fb.rids) if not self.writer.should_skip(rid)]
        if not candidates:
            return []
        starts = fb.extend_start_loc.tolist()
        lens, prefixes = fb.extend_seq_lens_cpu, fb.extend_prefix_lens_cpu
        if lens is None:  # init_new's gpu_only path leaves the *_cpu mirrors unset
            lens, prefixes = fb.extend_seq_lens.tolist(), fb.extend_prefix_lens.tolist()
        full = fb.orig_seq_lens.tolist() if fb.orig_seq_lens is not None else None
        rows = []
        for i in candidates:
            rid, prefix, n = fb.rids[i], int(prefixes[i]), int(lens[i])
            try:
                dump.check_rid(rid)
            except ValueError as e:
                logger.warning("eyas hook: not dumping %s", e)
                continue
            # A decode row (a running request in a MIXED batch, or a decode turned into a 1-token
            # extend under DP attention) looks like a 1-token chunk; it comes after the request's
            # last prefill chunk, which this hook saw. A new prefill of a rid starts at 0.
            if prefix == 0:
                self._prefilled.pop(rid, None)
            elif rid in self._prefilled:
                continue
            if n > 0:
                rows.append((rid, int(starts[i]), n, prefix))
            # orig_seq_lens = max(extend end, prompt length): reached only by the last chunk.
            if full is not None and prefix + n >= full[i]:
                self._prefilled[rid] = None
                while len(self._prefilled) > _MAX_TRACKED_RIDS:
                    self._prefilled.popitem(last=False)
        return rows

    def _dump(self, rows, input_ids: torch.Tensor, aux: torch.Tensor, last: torch.Tensor) -> None:
        end = max(start + n for _, start, n, _ in rows)
        if end > aux.shape[0] or end > input_ids.shape[0]:
            raise HookError(f"eyas hook: rows up to {end} requested, but the forward has "
                            f"{aux.shape[0]} hidden rows and {input_ids.shape[0]} input ids")
        # One device-to-host copy per tensor for the whole forward; the buffers are reused by the
        # next forward, so the copy must finish here. The file writes can wait.
        idx = torch.cat([torch.arange(s, s + n) for _, s, n, _ in rows]).to(aux.device)
        dtype = self.writer.dtype
        ids_cpu = input_ids.index_select(0, idx.to(input_ids.device)).to("cpu", torch.int32)
        aux_cpu = aux.index_select(0, idx).to("cpu", dtype)
        last_cpu = last.index_select(0, idx.to(last.device)).to("cpu", dtype)
        pos = 0
        for rid, _, n, prefix in rows:
            item = (rid, prefix, ids_cpu[pos:pos + n], aux_cpu[pos:pos + n], last_cpu[pos:pos + n])
            pos += n
            if self._queue is None:
                self.writer.write(*item)
            else:
                self._queue.put(item)  # blocks when max_pending chunks wait: bounded host memory

    # -- background writer ------------------------------------------------------------------------
    def _drain(self) -> None:
        while True:
            item = self._queue.get()
            try:
                if self._error is None:
                    self.writer.write(*item)
            except BaseException as e:  # noqa: BLE001 - re-raised in the next forward
                logger.exception("eyas hook: writing a dump record for rid %s failed", item[0])
                self._error = e
            finally:
                self._queue.task_done()

    def _wait(self, timeout: float | None = None) -> None:
        if self._queue is None:
            return
        deadline = None if timeout is None else time.monotonic() + timeout
        while self._queue.unfinished_tasks:
            if deadline is not None and time.monotonic() > deadline:
                break
            time.sleep(0.005)

    def flush(self, timeout: float | None = None) -> None:
        """Wait until every queued record is on disk (or timeout seconds pass); re-raise a failure."""
        self._wait(timeout)
        if self._error is not None:
            raise HookError(f"eyas hook: the dump writer failed: {self._error!r}") from self._error


def make_hook(config: dict, *, parallel: Any = None, via_forward_hooks: bool = True) -> DumpHook:
    """SGLang's hook factory (`hook_factory(config)` in model_executor/hook_manager.py).

    `parallel` stands in for sglang's get_parallel() (attn_tp_rank, attn_cp_rank); by default it
    is read from SGLang's runtime context at the first prefill. `via_forward_hooks=False` is for
    the patched deepseek_v2.py, which calls the hook itself.
    """
    config = dict(config or {})
    unknown = sorted(set(config) - set(CONFIG_KEYS))
    if unknown:
        raise HookError(f"eyas hook: unknown config keys {unknown}; known: {list(CONFIG_KEYS)}")
    dump_dir = config.get("dump_dir") or os.environ.get(dump.DUMP_DIR_ENV)
    if not dump_dir:
        raise HookError(f"eyas hook: no dump_dir in the hook config and {dump.DUMP_DIR_ENV} unset")
    features = _capture_features()
    if via_forward_hooks and features is not None and _capture_only_mode(features) is None:
        # Registered through --forward-hooks (eyas passes it to capture launches only), but the
        # server keeps no last hidden states: every request would wait for records in vain.
        raise HookError("eyas hook: registered through --forward-hooks, but SGLang runs without "
                        "capture-only mode; launch with --enable-return-aux-hidden-states "
                        "--speculative-algorithm EAGLE3 --return-aux-hidden-state-layer-ids ...")
    architecture = config.get("architecture")
    layer_ids = resolve_layer_ids(config.get("layer_ids"), _server_layer_ids(), architecture)
    if config.get("dtype") and config["dtype"] not in dump.DTYPES:
        raise HookError(f"eyas hook: config.dtype={config['dtype']!r}, expected one of {sorted(dump.DTYPES)}")
    dtype = dump.DTYPES[config["dtype"]] if config.get("dtype") else dump.dtype_from_env()
    rid_prefix = config.get("rid_prefix", "eyas-") or None
    writer = dump.DumpWriter(dump_dir, layer_ids=layer_ids, layer_convention="capture-before",
                             last_hidden_norm="post", dtype=dtype, rid_prefix=rid_prefix)
    logger.info("eyas hook: dumping prefill rows of rids %s* to %s, layers %s (capture-before), %s",
                rid_prefix or "", dump_dir, layer_ids, dtype)
    return DumpHook(writer, parallel=parallel, max_pending=int(config.get("max_pending", 4)),
                    via_forward_hooks=via_forward_hooks)
