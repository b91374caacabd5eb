"""What the local server's tests share: random prompts for the random tiny target, a plain greedy
reference to check generated tokens against, and the speculative-decoding flags."""

from __future__ import annotations

import torch

SPEC_FLAGS = [
    "--speculative-algorithm",
    "EAGLE3",
    "--speculative-num-steps",
    "3",
    "--speculative-eagle-topk",
    "1",
    "--speculative-num-draft-tokens",
    "4",
]


def reference_model(folder):
    """The target loaded with Hugging Face's from_pretrained, which shares no code with the server's
    loader."""
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(1)
    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def greedy_reference(model, ids: list[int], max_new: int, eos: int = 1) -> list[int]:
    """Plain greedy decoding: a full forward over the whole sequence for every new token."""
    seq, out = list(ids), []
    with torch.no_grad():
        for _ in range(max_new):
            token = int(model(torch.tensor([seq])).logits[0, -1].argmax())
            out.append(token)
            if token == eos:
                break
            seq.append(token)
    return out


def prompt(n: int, seed: int) -> list[int]:
    return torch.randint(3, 512, (n,), generator=torch.Generator().manual_seed(seed)).tolist()
