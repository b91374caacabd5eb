"""Quality sweep of the embedded default's drafter on a lent GPU (docs/training.md, "Quality").

    # here: a data variant
    python scripts/quality_data.py r64 30901 '{"data.regenerate.max_new_tokens": 64}'
    # there: the sweep
    python3 scripts/quality_sweep.py --variants sweep.json --par 14

Rebuilds each data variant's shards from its token ids (the tiny target on the GPU, the states in
bf16 as extraction stores them), trains every variant of sweep.json ([{"name", "data",
"overrides"}], overrides as dotted config fields on configs/local-tiny.yaml) in parallel processes,
exports each drafter, and measures what the pipeline measures: the real chain acceptance length at
3/1/4 on the 32 held-out prompts (on the CPU), plus the drafter's teacher-forced first-step accuracy
on the target's own continuations, overall and where a trigram seen earlier in the text predicts the
token (in-context copies: the tiny target loops). One JSON line per variant in $OUT/results.jsonl.
The GPU machine lacks pydantic: carry its wheels (the device tool's README says how).

A variant may name `"encoding": "fp8_e4m3"`: its shards are then written as extraction writes them
with `extraction.encoding: fp8_e4m3` (the same bf16 states, quantized by eyas.extraction.shards'
writer), and training reads them through ShardReader as the pipeline does. Every encoding of a data
variant is written from the same recomputed states, so plain and fp8 variants differ in the storage
alone. Train on the CPU with `"training.device": "cpu"` in a variant's overrides (the figure of
record is CPU-trained); `"evaluation.draft_steps": [3, 7]` measures 7/1/8 too (`al_by_setting`).
"""

import argparse
import collections
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
import torch  # noqa: E402 - after the checkout joins sys.path, as the eyas imports below


def shard_dir(out, data, encoding="plain"):
    """Where a data variant's shards in one encoding live (plain keeps its old name)."""
    return f"{out}/shards-{Path(data).stem}" + ("" if encoding == "plain" else f"-{encoding}")


def build_shards(data_pt, out_dirs, device):
    """Recompute each sequence's states with the tiny target and write them once per encoding:
    out_dirs maps an encoding ("plain", "fp8_e4m3") to its folder. The states are cast to bf16
    first, as the server dumps them; the fp8 writer quantizes those bf16 values, as extraction
    does."""
    from transformers import AutoModelForCausalLM

    from eyas.extraction.shards import Sample, write_shard

    todo = {enc: Path(o) for enc, o in out_dirs.items() if not (Path(o) / "done").exists()}
    if not todo:
        return
    d = torch.load(data_pt)
    for o in todo.values():
        o.mkdir(parents=True, exist_ok=True)
    t = (
        AutoModelForCausalLM.from_pretrained(
            str(ROOT / "fixtures/tiny-target"), dtype=torch.float32
        )
        .eval()
        .to(device)
    )
    manifests = {enc: [] for enc in todo}
    for si, sh in enumerate(d["shards"]):
        samples, capture = [], sh["meta"]["capture_ids"]  # the layers the pipeline's shards hold
        for ids, mask in sh["samples"]:
            with torch.no_grad():
                o = t(ids.long()[None].to(device), output_hidden_states=True)
            aux = torch.cat([o.hidden_states[i] for i in capture], -1)[0].bfloat16().cpu()
            samples.append(
                Sample(
                    input_ids=ids.int(),
                    loss_mask=mask.bool(),
                    aux_hidden_states=aux,
                    last_hidden_state=o.hidden_states[-1][0].bfloat16().cpu(),
                )
            )
        meta = {**sh["meta"], "target_checkpoint": str(ROOT / "fixtures/tiny-target")}
        for enc, o in todo.items():
            m = write_shard(o / f"shard-{si:05d}.safetensors", samples, meta, encoding=enc)
            manifests[enc].append(
                {k: m[k] for k in ("num_samples", "num_tokens", "encoding", "fp8_error") if k in m}
                | {"bytes": (o / f"shard-{si:05d}.safetensors").stat().st_size}
            )
    for enc, o in todo.items():
        (o / "manifests.json").write_text(json.dumps(manifests[enc]))
        (o / "done").write_text("ok")


def copy_prediction(seq, t, n):
    """The token after the last earlier occurrence of the n tokens ending at t+1 (None if none)."""
    ctx = seq[t + 2 - n : t + 2]
    for j in range(t, n - 2, -1):
        if seq[j - n + 1 : j + 1] == ctx:
            return seq[j + 1]
    return None


def diag(drafter, target, prompts, cap, eos):
    from eyas.evaluation.evaluate import _aux, target_greedy
    from eyas.training.drafter import causal_mask

    c = collections.Counter()
    with torch.no_grad():
        for p in prompts:
            seq = p + target_greedy(target, p, 48, eos)
            o = target(torch.tensor([seq]), output_hidden_states=True)
            aux = _aux(o, cap)[:, :-1]
            ids = seq[1:]
            T = len(ids)
            lg, _ = drafter(torch.tensor([ids]), aux, torch.arange(T), causal_mask(T))
            pred = drafter.to_target_ids(lg[0].argmax(-1)).tolist()
            for t in range(len(p) - 1, len(seq) - 2):
                gold = seq[t + 2]
                ok = pred[t] == gold
                c["n"] += 1
                c["ok"] += ok
                tri = copy_prediction(seq, t, 3)
                if tri is not None and tri == gold:
                    c["tri_n"] += 1
                    c["tri_ok"] += ok
    return {
        "step1_acc": c["ok"] / c["n"],
        "copy3_acc": c["tri_ok"] / max(1, c["tri_n"]),
        "copy3_n": c["tri_n"],
    }


def worker(name, overrides, shard_dir, out_dir, data_pt, with_diag=True):
    from transformers import AutoModelForCausalLM

    from eyas.config import load_config
    from eyas.evaluation.evaluate import _eos_ids, evaluate_acceptance
    from eyas.evaluation.export import export_drafter, load_exported
    from eyas.training.train import train_drafter

    out = Path(out_dir) / name
    out.mkdir(parents=True, exist_ok=True)
    ov = {
        "training.output_dir": str(out / "train"),
        "training.checkpoint_every": 100000,
        "evaluation.draft_steps": [3],
        "evaluation.device": "cpu",
    }
    ov.update(overrides)
    cfg = load_config(ROOT / "configs/local-tiny.yaml", ov)
    shards = sorted(Path(shard_dir).glob("shard-*.safetensors"))
    t0 = time.time()
    logf = open(out / "train.log", "w")
    res = train_drafter(
        cfg.training, cfg.target, shards, log=lambda s: (logf.write(s + "\n"), logf.flush())
    )
    t_train = time.time() - t0
    from eyas.extraction.shards import ShardReader

    meta = ShardReader(shards[0]).meta
    ddir = export_drafter(
        res.checkpoint_dir, out / "drafter", target=cfg.target, export=cfg.export, shard_meta=meta
    )
    torch.set_num_threads(2)
    prompts = torch.load(data_pt)["prompts"]
    ev = evaluate_acceptance(
        ddir, cfg.target.checkpoint, prompts, cfg.evaluation, cfg.target.capture_ids()
    )
    dg = {}
    if with_diag:
        drafter, _, m = load_exported(ddir, target_checkpoint=cfg.target.checkpoint)
        target = AutoModelForCausalLM.from_pretrained(
            str(cfg.target.checkpoint), dtype=torch.float32
        ).eval()
        dg = diag(drafter, target, prompts, cfg.target.capture_ids(), _eos_ids(target))
    r = {
        "name": name,
        "overrides": overrides,
        "encoding": meta.get("encoding", "plain"),
        "al": round(ev.acceptance_length, 4),
        "al_by_setting": {k: round(v["acceptance_length"], 4) for k, v in ev.settings.items()},
        "identical": ev.identical_to_target,
        "eval_s": ev.seconds,
        "train_device": str(cfg.training.device),
        "sim_al": res.simulated_acceptance_length,
        "final_loss": res.final_loss,
        "train_s": round(t_train, 1),
        "steps": res.steps,
        **{k: round(v, 4) if isinstance(v, float) else v for k, v in dg.items()},
    }
    (out / "result.json").write_text(json.dumps(r))
    print(json.dumps(r), flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--variants", required=True)  # json file: [{name, data, overrides}]
    ap.add_argument("--par", type=int, default=8)
    ap.add_argument("--out", default="/tmp/sweep")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--one", default=None)
    ap.add_argument(
        "--no-diag", action="store_true", help="skip the first-step accuracy diagnostics"
    )
    ap.add_argument(
        "--skip-build", action="store_true", help="the shards are built already (another sweep)"
    )
    a = ap.parse_args()
    variants = json.loads(Path(a.variants).read_text())
    if a.one:
        v = next(v for v in variants if v["name"] == a.one)
        worker(
            v["name"],
            v["overrides"],
            shard_dir(a.out, v["data"], v.get("encoding", "plain")),
            a.out,
            v["data"],
            with_diag=not a.no_diag,
        )
        return
    t0 = time.time()
    for data in sorted({v["data"] for v in variants}):
        encs = sorted({v.get("encoding", "plain") for v in variants if v["data"] == data})
        if not a.skip_build:
            build_shards(data, {e: shard_dir(a.out, data, e) for e in encs}, a.device)
    print(f"shards built in {time.time() - t0:.0f}s", flush=True)
    env = dict(os.environ, OMP_NUM_THREADS="2")
    pending, running = list(variants), []
    resfile = Path(os.environ.get("OUT", a.out)) / "results.jsonl"
    while pending or running:
        while pending and len(running) < a.par:
            v = pending.pop(0)
            lf = open(f"{a.out}/{v['name']}.log", "w")
            running.append(
                (
                    v,
                    subprocess.Popen(
                        [
                            sys.executable,
                            __file__,
                            "--variants",
                            a.variants,
                            "--out",
                            a.out,
                            "--one",
                            v["name"],
                        ]
                        + ["--no-diag"] * a.no_diag,
                        env=env,
                        stdout=lf,
                        stderr=subprocess.STDOUT,
                    ),
                )
            )
        time.sleep(2)
        for v, p in list(running):
            if p.poll() is not None:
                running.remove((v, p))
                rf = Path(a.out) / v["name"] / "result.json"
                line = (
                    rf.read_text()
                    if rf.exists()
                    else json.dumps(
                        {
                            "name": v["name"],
                            "failed": p.returncode,
                            "log": Path(f"{a.out}/{v['name']}.log").read_text()[-1500:],
                        }
                    )
                )
                with open(resfile, "a") as f:
                    f.write(line + "\n")
                print(f"[{time.time() - t0:.0f}s] {line}", flush=True)


if __name__ == "__main__":
    main()
