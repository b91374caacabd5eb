"""Parsing a /generate body as SGLang takes it; every error is a BadRequest naming the field."""

from __future__ import annotations

import uuid
from typing import Any

from eyas.dump import DUMP_DIR_ENV, check_rid
from eyas.local.engine import BadRequest

# Sampling params SGLang accepts that eyas-local does not implement: allowed only at the value
# that means "off", so a client relying on them fails loudly instead of being silently ignored.
_NEUTRAL_SAMPLING = {
    "top_p": 1.0,
    "top_k": -1,
    "min_p": 0.0,
    "frequency_penalty": 0.0,
    "presence_penalty": 0.0,
    "repetition_penalty": 1.0,
    "n": 1,
}
_SAMPLING_KEYS = {
    "max_new_tokens",
    "temperature",
    "sampling_seed",
    "ignore_eos",
    "stop_token_ids",
    "skip_special_tokens",
    "spaces_between_special_tokens",
    "no_stop_trim",
    *_NEUTRAL_SAMPLING,
}
# Top-level /generate fields accepted only when false/empty (eyas gets hidden states from the dump).
_FALSY_FIELDS = {
    "stream",
    "return_logprob",
    "return_hidden_states",
    "logprob_start_len",
    "top_logprobs_num",
    "return_text_in_logprobs",
    "log_metrics",
    "lora_path",
    "custom_logit_processor",
    "bootstrap_host",
    "bootstrap_room",
}
_GENERATE_KEYS = {"input_ids", "text", "rid", "sampling_params", *_FALSY_FIELDS}


def parse_sampling(raw: Any, where: str) -> dict[str, Any]:
    """One request's sampling_params with SGLang's defaults filled in (where: the field's name)."""
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise BadRequest(f"{where} must be an object, got {type(raw).__name__}")
    unknown = sorted(set(raw) - _SAMPLING_KEYS)
    if unknown:
        raise BadRequest(f"{where} has unknown fields {unknown}")
    for key, neutral in _NEUTRAL_SAMPLING.items():
        if key in raw and raw[key] != neutral:
            raise BadRequest(
                f"{where}.{key}={raw[key]!r} is not supported by eyas-local (only {neutral!r})"
            )
    p = {
        "max_new_tokens": raw.get("max_new_tokens", 128),
        "temperature": raw.get("temperature", 1.0),
        "sampling_seed": raw.get("sampling_seed"),
        "ignore_eos": raw.get("ignore_eos", False),
        "stop_token_ids": raw.get("stop_token_ids") or [],
        "skip_special_tokens": raw.get("skip_special_tokens", True),
    }
    if not _is_int(p["max_new_tokens"]) or p["max_new_tokens"] < 0:
        raise BadRequest(
            f"{where}.max_new_tokens must be an integer >= 0, got {p['max_new_tokens']!r}"
        )
    t = p["temperature"]
    if isinstance(t, bool) or not isinstance(t, (int, float)) or not t >= 0:
        raise BadRequest(f"{where}.temperature must be a number >= 0, got {t!r}")
    if p["sampling_seed"] is not None and not _is_int(p["sampling_seed"]):
        raise BadRequest(f"{where}.sampling_seed must be an integer, got {p['sampling_seed']!r}")
    if not isinstance(p["stop_token_ids"], list) or not all(
        _is_int(i) for i in p["stop_token_ids"]
    ):
        raise BadRequest(f"{where}.stop_token_ids must be a list of integers")
    return p


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _texts(texts: Any, tokenizer) -> tuple[list[list[int]], bool]:
    if tokenizer is None:
        raise BadRequest(
            "text needs a tokenizer, and the model folder has no tokenizer.json; send input_ids"
        )
    batched = isinstance(texts, list)
    texts = texts if batched else [texts]
    if not texts or not all(isinstance(t, str) for t in texts):
        raise BadRequest("text must be a string or a non-empty list of strings")
    return [tokenizer.encode(t) for t in texts], batched


def _input_ids(raw: Any, vocab_size: int) -> tuple[list[list[int]], bool]:
    if not isinstance(raw, list) or not raw:
        raise BadRequest("input_ids must be a non-empty list of token ids, or a list of such lists")
    batched = isinstance(raw[0], list)
    seqs = raw if batched else [raw]
    for b, seq in enumerate(seqs):
        name = f"input_ids[{b}]" if batched else "input_ids"
        if not isinstance(seq, list) or not seq:
            raise BadRequest(f"{name} must be a non-empty list of token ids")
        for i, tok in enumerate(seq):
            if not _is_int(tok) or not 0 <= tok < vocab_size:
                raise BadRequest(
                    f"{name}[{i}] = {tok!r} is outside the vocabulary (0..{vocab_size - 1})"
                )
    return seqs, batched


# One check per field of SGLang's /generate body, each refused by name: a flat list reads best.
def parse_generate(  # noqa: C901
    body: Any, vocab_size: int, tokenizer
) -> tuple[list[tuple[list[int], str, dict]], bool]:
    """A /generate body -> ([(input_ids, rid, sampling)], batched) or BadRequest naming the
    field."""
    if not isinstance(body, dict):
        raise BadRequest(f"the request body must be a JSON object, got {type(body).__name__}")
    unknown = sorted(set(body) - _GENERATE_KEYS)
    if unknown:
        raise BadRequest(f"unknown fields {unknown}")
    for key in sorted(_FALSY_FIELDS & set(body)):
        if key == "log_metrics" or (key == "logprob_start_len" and body[key] == -1):
            continue  # SGLang's defaults (log_metrics=True, logprob_start_len=-1)
        if body[key]:
            raise BadRequest(
                f"{key}={body[key]!r} is not supported by eyas-local (hidden states "
                f"come through {DUMP_DIR_ENV}, not the response)"
            )
    if ("input_ids" in body) == ("text" in body):
        raise BadRequest("give exactly one of input_ids and text")

    seqs, batched = (
        _texts(body["text"], tokenizer)
        if "text" in body
        else _input_ids(body["input_ids"], vocab_size)
    )
    rids = body.get("rid")
    if rids is None:
        rids = [uuid.uuid4().hex for _ in seqs]
    elif batched != isinstance(rids, list):
        raise BadRequest(
            f"rid must be {'a list (batch input)' if batched else 'a string'}, got {rids!r}"
        )
    elif not batched:
        rids = [rids]
    if len(rids) != len(seqs):
        raise BadRequest(f"rid has {len(rids)} entries for {len(seqs)} sequences")
    for (
        rid
    ) in rids:  # a rid names its dump folder: safe characters and length (before set(): hashable)
        try:
            check_rid(rid)
        except ValueError as e:
            raise BadRequest(f"rid: {e}") from None
    if len(set(rids)) != len(rids):
        raise BadRequest(f"rid has duplicates: {rids}")

    sp = body.get("sampling_params")
    if isinstance(sp, list):
        if len(sp) != len(seqs):
            raise BadRequest(f"sampling_params has {len(sp)} entries for {len(seqs)} sequences")
        params = [parse_sampling(s, f"sampling_params[{i}]") for i, s in enumerate(sp)]
    else:
        params = [parse_sampling(sp, "sampling_params")] * len(seqs)
    return list(zip(seqs, rids, params)), batched
