"""The acceptance arithmetic, one copy for both ways of measuring it (in process, through a server).

    rec = prompt_record(prompt_tokens=12, output=[...], verify_steps=5, reference=[...])
    # acceptance_length, verify_steps, identical_to_target, per_prompt
    fig = pooled([rec, ...])
    chain_name(3) == "3/1/4"

Acceptance length is SGLang's: completion tokens / verify steps (`meta_info.completion_tokens /
meta_info.spec_verify_ct`), so the token the prefill produces counts too, and a prompt answered by
that token alone has no verify step. Pooled over prompts it is sum(tokens) / sum(verify steps),
the figure SGLang's and SpecForge's benchmarks print; the per-prompt figures say how it spreads.
"""

from __future__ import annotations


def chain_name(steps: int, topk: int = 1, draft_tokens: int | None = None) -> str:
    """SGLang's steps/topk/draft-tokens spelling: a chain of 3 drafts is 3/1/4."""
    return f"{steps}/{topk}/{steps + 1 if draft_tokens is None else draft_tokens}"


def prompt_record(
    prompt_tokens: int, output: list[int], verify_steps: int, reference: list[int] | None = None
) -> dict:
    """One prompt's figures; `identical` compares with the reference output and `same_prefix` counts
    the leading tokens both share (None: no reference)."""
    same = (
        None
        if reference is None
        else next(
            (i for i, (a, b) in enumerate(zip(output, reference)) if a != b),
            min(len(output), len(reference)),
        )
    )
    return {
        "prompt_tokens": prompt_tokens,
        "new_tokens": len(output),
        "verify_steps": verify_steps,
        "acceptance_length": round(len(output) / verify_steps, 4) if verify_steps else None,
        "identical": None if reference is None else list(output) == list(reference),
        "same_prefix": same,
    }


def pooled(records: list[dict]) -> dict:
    """Over prompts: tokens / verify steps, draft tokens accepted per verify, output equality.

    accepted_per_verify leaves out each prompt's prefill token and each verify's bonus token (the
    target's own next token): the drafts the target agreed with, per verify step. With no verify
    step at all (every reply one token long) the acceptance length is 1.0: nothing was drafted.
    """
    tokens = sum(r["new_tokens"] for r in records)
    verify = sum(r["verify_steps"] for r in records)
    checked = [r["identical"] for r in records if r["identical"] is not None]
    return {
        "acceptance_length": tokens / verify if verify else 1.0,
        "num_prompts": len(records),
        "total_new_tokens": tokens,
        "verify_steps": verify,
        "accepted_per_verify": (tokens - len(records)) / verify - 1 if verify else 0.0,
        "identical_to_target": all(checked) if checked else None,
        "per_prompt": records,
    }
