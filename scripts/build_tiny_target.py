"""Build the tiny DeepSeek-V3 target fixture (fixtures/tiny-target); see docs/tiny-target.md.

All in one place (needs a GPU for a useful model; minutes on one H200):

    python scripts/build_tiny_target.py fixtures/tiny-target --steps 3000 --device cuda

How the committed fixture was built, across two machines (the tokenizer and the assembly here, the
training on a lent GPU that has torch but not this project's venv):

    python scripts/build_tiny_target.py --stage prepare --workdir .gpu_in/inputs
    python3 scripts/build_tiny_target.py --stage train --workdir .gpu_in/inputs --state $OUT/state
    \\
        --steps 3000 --device cuda --max-seconds 400              # on the GPU machine
    python scripts/build_tiny_target.py fixtures/tiny-target --stage assemble \\
        --workdir .gpu_in/inputs --state PATH/TO/state                # back here

fixtures/tiny-target-cpu, the variant real SGLang's CPU kernels serve, was built the same way with
`--variant cpu` added to the train and assemble stages (same inputs, steps and seed).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

# The GPU machine runs this from a bare copy of the tree, where eyas is not installed.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from eyas.local import tiny_corpus, tiny_target  # noqa: E402


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "out", type=Path, nargs="?", help="the Hugging Face folder to write (all, assemble)"
    )
    parser.add_argument("--stage", choices=["all", "prepare", "train", "assemble"], default="all")
    parser.add_argument(
        "--workdir", type=Path, help="prepare's output: tokenizer and token streams"
    )
    parser.add_argument("--state", type=Path, help="train's output: trained weights and metrics")
    parser.add_argument("--steps", type=int, default=3000)
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--max-seconds", type=float, default=None, help="stop training early after this long"
    )
    parser.add_argument(
        "--variant",
        choices=sorted(tiny_target.VARIANTS),
        default="default",
        help="cpu: the widths real SGLang's CPU kernels accept (train, assemble, all)",
    )
    args = parser.parse_args(argv)
    needs = {
        "all": ["out"],
        "prepare": ["workdir"],
        "train": ["workdir", "state"],
        "assemble": ["out", "workdir", "state"],
    }
    missing = [name for name in needs[args.stage] if getattr(args, name) is None]
    if missing:
        parser.error(f"--stage {args.stage} needs {', '.join(missing)}")

    if args.stage == "all":
        result = tiny_target.build_tiny_target(
            args.out,
            steps=args.steps,
            device=args.device,
            seed=args.seed,
            max_seconds=args.max_seconds,
            variant=args.variant,
        )
    elif args.stage == "prepare":
        result = tiny_corpus.prepare_inputs(args.workdir, seed=args.seed)
    elif args.stage == "train":
        result = tiny_target.train_from_inputs(
            args.workdir,
            args.state,
            steps=args.steps,
            device=args.device,
            seed=args.seed,
            max_seconds=args.max_seconds,
            variant=args.variant,
        )
    else:
        result = tiny_target.assemble(args.workdir, args.state, args.out, variant=args.variant)
    summary = {
        k: v
        for k, v in result.items()
        if k not in ("history", "training", "test_files", "val_files")
    }
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
