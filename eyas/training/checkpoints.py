"""Training checkpoints: written whole, then renamed into place; resumed exactly.

    state = load_checkpoint(latest_checkpoint(out_dir), objective, opt, sched, fingerprint, log)
    save_checkpoint(out_dir, objective, opt, sched, state, info, rank=rank)

`output_dir/checkpoints/step-NNNNNN/` holds `model.safetensors` (the trainable weights with d2t and
t2d, SGLang's names, fp32), `drafter.json` (sizes, the run's fingerprint, provenance) and
`trainer_state.pt` (optimizer, scheduler, TrainState, RNG). Model and optimizer state go through
torch.distributed.checkpoint's full state dicts, so a checkpoint written under FSDP (gathered for
rank 0) loads on one process and the other way round.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file


@dataclass
class TrainState:
    step: int = 0
    epoch: int = 0
    batch_pos: int = 0  # steps of this epoch already taken
    tokens: int = 0
    seconds: float = 0.0
    losses: list[float] = field(default_factory=list)
    accuracies: list[list[float]] = field(default_factory=list)
    heldout_history: list[list[float]] = field(default_factory=list)


def latest_checkpoint(output_dir: Path) -> Path | None:
    found = sorted((output_dir / "checkpoints").glob("step-[0-9]*"))
    return found[-1] if found else None


def _state_dicts(objective, opt):
    """Full (unsharded) model and optimizer state dicts; collective under FSDP, keys without 'drafter.'."""
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                         get_optimizer_state_dict)
    opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
    model = get_model_state_dict(objective, options=opts)
    model = {k.removeprefix("drafter."): v for k, v in model.items() if k != "drafter.embed_tokens.weight"}
    return model, get_optimizer_state_dict(objective, opt, options=opts)


def save_checkpoint(output_dir: Path, objective, opt, sched, state: TrainState, info: dict, *,
                    rank: int = 0, keep: int = 2) -> Path:
    """Write checkpoints/step-NNNNNN whole in a temp folder, then rename it into place (rank 0 writes)."""
    model_sd, opt_sd = _state_dicts(objective, opt)
    root = output_dir / "checkpoints"
    final = root / f"step-{state.step:06d}"
    if rank == 0:
        tmp = root / f".tmp-step-{state.step:06d}-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        save_file({k: v.detach().contiguous().cpu() for k, v in model_sd.items()},
                  str(tmp / "model.safetensors"))
        (tmp / "drafter.json").write_text(json.dumps(info, indent=2, sort_keys=True) + "\n")
        rng = {"torch": torch.get_rng_state(),
               "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else []}
        torch.save({"optimizer": opt_sd, "scheduler": sched.state_dict(), "state": asdict(state),
                    "rng": rng, "fingerprint": info["fingerprint"]}, tmp / "trainer_state.pt")
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        for old in sorted(root.glob("step-[0-9]*"))[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
    if dist.is_initialized():
        dist.barrier()
    return final


def load_checkpoint(path: Path, objective, opt, sched, fingerprint: dict, log) -> TrainState:
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, set_model_state_dict,
                                                         set_optimizer_state_dict)
    ckpt = torch.load(path / "trainer_state.pt", map_location="cpu", weights_only=False)
    old = ckpt["fingerprint"]
    differ = sorted(k for k in set(old) | set(fingerprint) if k != "max_steps" and old.get(k) != fingerprint.get(k))
    if differ:
        raise ValueError(f"{path}: checkpoint is from a different run ({', '.join(differ)} differ); "
                         f"remove {path.parent} or use another training.output_dir")
    if old.get("max_steps") != fingerprint.get("max_steps"):
        log(f"resuming with max_steps {fingerprint['max_steps']} (checkpoint ran with {old['max_steps']})")
    weights = load_file(str(path / "model.safetensors"))
    opts = StateDictOptions(full_state_dict=True, strict=False)
    result = set_model_state_dict(objective, {"drafter." + k: v for k, v in weights.items()}, options=opts)
    missing = [k for k in result.missing_keys if k != "drafter.embed_tokens.weight"]
    if missing or result.unexpected_keys:
        raise ValueError(f"{path}: checkpoint weights do not fit the drafter (missing {missing}, "
                         f"unexpected {result.unexpected_keys})")
    set_optimizer_state_dict(objective, opt, ckpt["optimizer"], options=StateDictOptions(full_state_dict=True))
    sched.load_state_dict(ckpt["scheduler"])
    torch.set_rng_state(ckpt["rng"]["torch"])
    if ckpt["rng"]["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(ckpt["rng"]["cuda"])
    return TrainState(**ckpt["state"])
