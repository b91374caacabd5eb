"""The training step's goal rows alone (bench/train.py's chat-shaped rows at batch 4), for a code
tree.

    # once, where the fixtures are
    python bench/masks.py --out .perf/chat_masks.npy
    # the commit to compare with
    git archive COMMIT | tar -x -C _base
    python3 bench/train_goal_rows.py --root _base --out $OUT/base.jsonl
    python3 bench/train_goal_rows.py --out $OUT/new.jsonl

Imports bench/train.py and eyas from --root (so one call can time two commits one after the other on
one GPU) and runs only its goal rows: the Kimi-size step at --batch over real conversations packed,
a prompt of 0.3 and every position scored, with the default variant (a run's later epochs) and,
while
--budget-s lasts, `nomemo` (its first epoch). Skips the kernel checks, eager rows, breakdown and
profile that bench/train.py adds (minutes of compiling). One JSON line per row, appended to --out as
it is measured, so a call cut short keeps what it measured; the last line is the usual
{"bench", "figures", "goals"} (the goals of bench/train.py for --batch).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from types import SimpleNamespace

ROWS = (("masks-from", "file"), ("prompt-0.3", "prefix:0.3"), ("all-scored", "prefix:0"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--root", default=str(Path(__file__).resolve().parents[1]), help="the code tree to time"
    )
    ap.add_argument(
        "--masks-from",
        default=str(Path(__file__).resolve().parents[1] / ".perf" / "chat_masks.npy"),
        help="bool [N, T] .npy of packed conversations (bench/masks.py; default "
        ".perf/chat_masks.npy)",
    )
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument(
        "--variants",
        nargs="+",
        default=["default", "nomemo"],
        help="bench/train.py VARIANTS of --root, in this order: the later epochs' step (default), "
        "the first epoch's (nomemo), or a switch off (fp8, noemb, ...)",
    )
    ap.add_argument(
        "--masks",
        nargs="+",
        default=[name for name, _ in ROWS],
        choices=[name for name, _ in ROWS],
        help="which goal rows (default all three)",
    )
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument(
        "--budget-s",
        type=float,
        default=240.0,
        help="no row of a second variant starts after this many seconds",
    )
    ap.add_argument(
        "--tiny", action="store_true", help="a tiny drafter on the CPU: a smoke run of this script"
    )
    ap.add_argument("--out", default=None, help="JSON lines, one per row, appended as measured")
    args = ap.parse_args()
    root = str(Path(args.root).resolve())
    sys.path.insert(0, root)  # before this file's own folder: bench and eyas come from --root
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    import torch

    if (
        not torch.cuda.is_available() and not args.tiny
    ):  # the Kimi-size step needs a GPU's memory and speed
        print(
            json.dumps(
                {
                    "bench": "train_goal_rows",
                    "figures": {"skipped": "needs a CUDA GPU"},
                    "goals": {},
                }
            )
        )
        return
    import eyas
    from bench import train as bench
    from eyas.training.optim import lr_factor, make_optimizer

    t0 = time.perf_counter()
    device, dtype = (
        (torch.device("cpu"), torch.float32)
        if args.tiny
        else (torch.device("cuda"), torch.bfloat16)
    )
    c = bench.DrafterConfig(**(bench.TINY if args.tiny else bench.KIMI))
    T, K, B = 64 if args.tiny else 4096, 7, args.batch
    model, head = bench.build(c, device, dtype)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = make_optimizer(params, 1e-4, 0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_factor(s, 10, 1000))
    run = SimpleNamespace(warmup=args.warmup, steps=args.steps)
    env = {
        "eyas": eyas.__file__,
        "torch": torch.__version__,
        "device": "cpu" if args.tiny else torch.cuda.get_device_name(),
    }
    print(json.dumps(env), flush=True)
    out = Path(args.out) if args.out else None
    rows = []
    unknown = sorted(set(args.variants) - set(bench.VARIANTS))
    if unknown:
        ap.error(f"--variants: {unknown} not in {root}/bench/train.py VARIANTS")
    for i, variant in enumerate(args.variants):
        for name, kind in ROWS:
            if name not in args.masks or i and time.perf_counter() - t0 > args.budget_s:
                continue
            fn = bench.mask_source(kind, T, args.masks_from)
            r = bench.run_batch(
                model,
                head,
                opt,
                sched,
                c,
                B,
                T,
                K,
                device,
                dtype,
                run,
                bench.variant(variant, not args.tiny),
                mask_fn=fn,
                name=variant,
            )
            r.update(
                mask=name, variant=variant, root=root, elapsed_s=round(time.perf_counter() - t0, 1)
            )
            if out is not None:
                with out.open("a") as f:
                    f.write(json.dumps(bench.clean(r)) + "\n")
            print(
                f"{name} b{B} {variant}: {r['step_s'] * 1e3:.1f} ms/step, "
                f"{r['tokens_per_s']:.0f} tok/s, "
                f"peak {r['peak_gb']:.1f} GB, steps {r['step_s_all']}",
                flush=True,
            )
            rows.append(r)
            torch.cuda.empty_cache()
    figures = {
        "env": env,
        "rows": [
            {k: r[k] for k in ("mask", "variant", "step_s", "tokens_per_s", "peak_gb")}
            for r in rows
        ],
    }
    goals = bench.specforge_goals(rows, args.tiny, "default", 10)  # B's goals (nomemo: first epoch)
    goals = {k: v for k, v in goals.items() if f"_b{B}_" in k}
    print(
        json.dumps(bench.clean({"bench": "train_goal_rows", "figures": figures, "goals": goals})),
        flush=True,
    )


if __name__ == "__main__":
    main()
