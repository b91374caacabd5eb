"""Loss masks of chat shape for bench/train.py: a leading prompt share, or real conversations
packed.

    python bench/masks.py --out .perf/chat_masks.npy [--seq 4096]
        [--data fixtures/data/conversations.jsonl] [--tokenizer fixtures/tiny-target]

Writes the loss masks of the tokenized conversations eyas ships, exactly as eyas's data preparation
makes them (`eyas.extraction.data.prepare`: the target's chat template, 1 on assistant tokens, the
length policy `overlong: truncate` at --seq, the last --heldout conversations held out), packed
back to back in file order into rows of --seq tokens (the last, partial row dropped), so every row
holds replies with the user turns and template tokens between them unscored, as a packed
multi-turn batch does.

Store format: a NumPy `.npy` file (no pickle) holding one bool array of shape [N, T]: N rows of T
positions, True where the position is scored (an assistant token). `load_masks(path, T)` reads it
back and re-cuts the flattened stream to another row length T (the CPU smoke run uses T = 64).

The mask functions here need numpy only; `conversation_masks` imports eyas's data preparation
(pydantic, transformers) and is only needed to write the file, not to run the bench.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]


def prefix_masks(rows: int, T: int, fraction: float) -> np.ndarray:
    """bool [rows, T]: the first round(fraction * T) positions of each row unscored (a prompt), the
    rest scored."""
    if not 0.0 <= fraction < 1.0:
        raise ValueError(f"prompt fraction must be in [0, 1), got {fraction}")
    m = np.ones((rows, T), dtype=bool)
    m[:, : round(fraction * T)] = False
    return m


def pack(masks: list, T: int) -> np.ndarray:
    """Per-conversation masks (lists of 0/1) back to back, cut into rows of T; the partial tail is
    dropped."""
    flat = (
        np.concatenate([np.asarray(m, dtype=bool) for m in masks]) if masks else np.zeros(0, bool)
    )
    n = len(flat) // T
    if n == 0:
        raise ValueError(f"{len(flat)} tokens in all: not one row of {T}")
    return flat[: n * T].reshape(n, T)


def load_masks(path: str | Path, T: int) -> np.ndarray:
    """A mask file's rows, re-cut to rows of T positions (the same stream of conversations)."""
    m = np.load(path, allow_pickle=False)
    if m.dtype != np.bool_ or m.ndim != 2:
        raise ValueError(f"{path}: expected a bool [N, T] array, got {m.dtype} {m.shape}")
    return m if m.shape[1] == T else pack([m.reshape(-1)], T)


def unscored_share(m: np.ndarray) -> float:
    return float(1.0 - m.mean())


def conversation_masks(
    data: str | Path, tokenizer: str | Path, max_length: int, heldout: int = 32
) -> list:
    """The loss mask of every training conversation, as eyas's prepare-data stage produces it."""
    sys.path.insert(0, str(ROOT))
    from eyas.config import DataConfig
    from eyas.extraction.data import load_conversations, prepare
    from eyas.target import load_tokenizer

    cfg = DataConfig(
        path=Path(data), max_length=max_length, overlong="truncate", num_heldout=heldout
    )
    prepared = prepare(load_conversations(data), load_tokenizer(tokenizer), cfg)
    return [s.loss_mask for s in prepared.train]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="the .npy file to write")
    ap.add_argument(
        "--seq", type=int, default=4096, help="row length (bench/train.py's sequence length)"
    )
    ap.add_argument("--data", default=str(ROOT / "fixtures" / "data" / "conversations.jsonl"))
    ap.add_argument("--tokenizer", default=str(ROOT / "fixtures" / "tiny-target"))
    ap.add_argument(
        "--heldout", type=int, default=32, help="last conversations held out (local-tiny's 32)"
    )
    args = ap.parse_args()
    convs = conversation_masks(args.data, args.tokenizer, args.seq, args.heldout)
    m = pack(convs, args.seq)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    np.save(args.out, m, allow_pickle=False)
    lens = [len(c) for c in convs]
    print(
        f"{len(convs)} conversations, {sum(lens)} tokens (median {int(np.median(lens))}), "
        f"{sum(sum(c) for c in convs)} scored; packed into {m.shape[0]} rows of {m.shape[1]}: "
        f"unscored share {unscored_share(m):.3f} (per row "
        f"{m.mean(1).min():.3f}-{m.mean(1).max():.3f} scored) -> {args.out}"
    )


if __name__ == "__main__":
    main()
