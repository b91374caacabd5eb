"""Acceptance length of the exported drafter: greedy chain speculative decoding against the target.

    res = evaluate_acceptance(drafter_dir, target_checkpoint, prompts, cfg.evaluation, capture_ids)
    res.acceptance_length           # tokens per target verify step, as SGLang reports it
    res.settings["7/1/8"]           # one entry per evaluation.draft_steps (3/1/4, 7/1/8, ...)

Per prompt: the target prefills the prompt (its argmax is the first new token) and the drafter
prefills on the target's aux states; then each round the drafter proposes `draft_steps` tokens
autoregressively (its KV cache grows by one per draft), the target checks them all in one forward,
the longest agreeing prefix plus the target's own next token (the bonus) is kept, both KV caches
are rolled back to the kept tokens, and the drafter takes in the target's states for them.
Acceptance length = completion tokens / verify steps (SGLang's `completion_tokens /
spec_verify_ct`, so the prefill's token is counted too). The output is compared with plain greedy
decoding of the target alone: speculative decoding must not change a single token. Each setting
in `cfg.draft_steps` is a chain of that many draft steps, top-k 1, steps + 1 tokens per verify
(SGLang's steps/topk/draft-tokens, 3/1/4 and 7/1/8); the target's reference output is computed once.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from eyas.errors import InvalidInput
from eyas.evaluation.acceptance import chain_name, pooled, prompt_record
from eyas.training.drafter import KVCache, causal_mask

if TYPE_CHECKING:
    from eyas.config import EvaluationConfig


@dataclass
class EvalResult:
    acceptance_length: float  # completion tokens / verify steps over all prompts
    num_prompts: int
    total_new_tokens: int
    verify_steps: int
    identical_to_target: bool
    seconds: float
    accepted_per_verify: float = (
        0.0  # draft tokens accepted per verify step (no bonus, no prefill token)
    )
    per_prompt: list[dict] = field(default_factory=list)
    setting: str = ""  # the headline's "steps/1/steps+1"
    settings: dict[str, dict] = field(
        default_factory=dict
    )  # every setting: the fields above, per setting
    method: str = "in_process"  # evaluation.method: the target loaded here, not served


def _eos_ids(target) -> set[int]:
    """Stop tokens: the config's eos plus generation_config.json's (where chat models list
    end-of-turn)."""
    ids: set[int] = set()
    for cfg in (target.config, getattr(target, "generation_config", None)):
        eos = getattr(cfg, "eos_token_id", None)
        ids |= set() if eos is None else {eos} if isinstance(eos, int) else set(eos)
    return ids


@torch.no_grad()
def target_greedy(target, prompt: list[int], max_new_tokens: int, eos: set[int]) -> list[int]:
    """Plain greedy decoding with the target alone (KV cache), the reference output."""
    dev = target.device
    out = target(torch.tensor([prompt], device=dev), use_cache=True)
    past, new = out.past_key_values, [int(out.logits[0, -1].argmax())]
    while len(new) < max_new_tokens and new[-1] not in eos:
        out = target(torch.tensor([[new[-1]]], device=dev), past_key_values=past, use_cache=True)
        past = out.past_key_values
        new.append(int(out.logits[0, -1].argmax()))
    return new


def _aux(out, capture_ids: list[int]) -> torch.Tensor:
    return torch.cat([out.hidden_states[i] for i in capture_ids], dim=-1)  # (1, T, 3H)


@torch.no_grad()
def speculative_greedy(
    target,
    drafter,
    prompt: list[int],
    capture_ids: list[int],
    draft_steps: int,
    max_new_tokens: int,
    eos: set[int],
) -> tuple[list[int], int]:
    """Greedy chain speculative decoding -> (new tokens, verify steps)."""
    dev = target.device
    out = target(torch.tensor([prompt], device=dev), use_cache=True, output_hidden_states=True)
    past, new = out.past_key_values, [int(out.logits[0, -1].argmax())]
    cache, verify_steps = KVCache(), 0
    # drafter prefill: position t pairs the target's states at t with token t+1
    ids, aux, start = prompt[1:] + new, _aux(out, capture_ids), 0
    while len(new) < max_new_tokens and new[-1] not in eos:
        T = len(ids)
        logits, h = drafter(
            torch.tensor([ids], device=dev),
            aux,
            torch.arange(start, start + T, device=dev),
            causal_mask(T, len(cache), device=dev),
            cache=cache,
        )
        committed = len(cache)  # drafter entries backed by target states: positions 0..committed-1
        drafts = [int(drafter.to_target_ids(logits[0, -1].argmax()))]
        h = h[:, -1:]
        for k in range(1, draft_steps):
            logits, h = drafter(
                torch.tensor([[drafts[-1]]], device=dev),
                h,
                torch.tensor([committed - 1 + k], device=dev),
                causal_mask(1, len(cache), device=dev),
                cache=cache,
            )
            drafts.append(int(drafter.to_target_ids(logits[0, -1].argmax())))
        # the target checks [last token, drafts...] in one forward
        out = target(
            torch.tensor([[new[-1]] + drafts], device=dev),
            past_key_values=past,
            use_cache=True,
            output_hidden_states=True,
        )
        past, preds = out.past_key_values, out.logits[0].argmax(-1).tolist()
        verify_steps += 1
        a = 0
        while a < draft_steps and drafts[a] == preds[a]:
            a += 1
        accepted = drafts[:a] + [preds[a]]
        for tok in accepted:  # stop exactly where plain greedy decoding would
            if len(new) >= max_new_tokens or new[-1] in eos:
                break
            new.append(tok)
        past.crop(-(draft_steps - a))  # keep the last token and the accepted drafts
        cache.crop(committed)
        ids, aux, start = accepted, _aux(out, capture_ids)[:, : a + 1], committed
    return new, verify_steps


def evaluate_acceptance(
    drafter_dir: str | Path,
    target_checkpoint: str | Path,
    prompts: list[list[int]],
    cfg: EvaluationConfig,
    capture_ids: list[int],
) -> EvalResult:
    """Acceptance length of the exported drafter over prompts (token ids), checked against the
    target."""
    from transformers import AutoModelForCausalLM

    from eyas.evaluation.export import load_exported

    if not prompts or any(len(p) < 2 for p in prompts):
        raise InvalidInput(
            "evaluate_acceptance: needs at least one prompt, each of 2 or more tokens"
        )
    t0 = time.monotonic()
    drafter, _, meta = load_exported(drafter_dir, target_checkpoint=target_checkpoint)
    written = meta["eagle_config"]["eagle_aux_hidden_state_layer_ids"]
    if list(written) != list(capture_ids):
        raise InvalidInput(
            f"{drafter_dir}: the drafter reads layers {written}, evaluation was asked "
            f"for {capture_ids}"
        )
    device = torch.device(cfg.device)
    target = AutoModelForCausalLM.from_pretrained(
        str(target_checkpoint), dtype=torch.float32
    ).eval()
    target.to(device)
    drafter.to(device)
    eos = _eos_ids(target)
    refs = [target_greedy(target, prompt, cfg.max_new_tokens, eos) for prompt in prompts]
    settings = {}
    for steps in cfg.draft_steps:
        records = []
        for prompt, ref in zip(prompts, refs):
            spec, n = speculative_greedy(
                target, drafter, prompt, capture_ids, steps, cfg.max_new_tokens, eos
            )
            records.append(prompt_record(len(prompt), spec, n, reference=ref))
        settings[chain_name(steps)] = pooled(records)
    head, first = next(iter(settings)), next(iter(settings.values()))
    return EvalResult(
        acceptance_length=first["acceptance_length"],
        num_prompts=len(prompts),
        total_new_tokens=first["total_new_tokens"],
        verify_steps=first["verify_steps"],
        identical_to_target=all(s["identical_to_target"] for s in settings.values()),
        seconds=round(time.monotonic() - t0, 3),
        accepted_per_verify=first["accepted_per_verify"],
        per_prompt=first["per_prompt"],
        setting=head,
        settings=settings,
    )
