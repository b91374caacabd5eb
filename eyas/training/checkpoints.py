"""Training checkpoints: written whole, then renamed into place; resumed exactly.

    state = load_checkpoint(resumable_checkpoint(out_dir, warn), objective, opt, sched, fingerprint,
    log) save_checkpoint(out_dir, objective, opt, sched, state, info, rank=rank)

`output_dir/checkpoints/step-NNNNNN/` holds `model.safetensors` (the trainable weights with d2t and
t2d, SGLang's names, fp32), `drafter.json` (sizes, the run's fingerprint, provenance),
`trainer_state.pt` (optimizer, scheduler, TrainState, RNG, and with training.ema_decay the weight
average, eyas/training/ema.py) and `checksums.json` (each file's size and sha256, recorded in the
temp folder before the rename, so a checkpoint in place always has them).

A resume takes the newest intact checkpoint (resumable_checkpoint). A damaged one (a file that
differs from its checksums, truncated or overwritten; or, written before checksums existed, one that
does not load) is named in the log, moved to `output_dir/checkpoints.quarantine/` (kept, never
deleted) and skipped. Model and optimizer state go through
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

from eyas.errors import InvalidInput
from eyas.files import atomic_dir, sha256_file

FILES = ("model.safetensors", "drafter.json", "trainer_state.pt")
SUMS = "checksums.json"  # {"format": SUMS_FORMAT, "files": {name: {"bytes", "sha256"}}}
SUMS_FORMAT = "eyas-checkpoint-sums/1"


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
    history: list[dict] = field(default_factory=list)  # the bounded loss table (StepStats.row())
    init_from: dict | None = None  # a warm start's source (training.init_from): path, kind


def quarantine_dir(output_dir: Path) -> Path:
    return Path(output_dir) / "checkpoints.quarantine"


def damage(path: Path) -> str | None:
    """Why the checkpoint at path cannot be resumed as it was written (None: intact).

    With checksums.json: every file's size, then its sha256. Without one (an eyas that recorded no
    checksums wrote it): trusted if it loads, so each file is read as resuming reads it."""
    missing = [name for name in FILES if not (path / name).is_file()]
    if missing:
        return f"{', '.join(missing)} missing"
    if (path / SUMS).is_file():
        try:
            files = json.loads((path / SUMS).read_text())["files"]
            want = {name: (int(files[name]["bytes"]), str(files[name]["sha256"])) for name in FILES}
        except (ValueError, KeyError, TypeError) as e:
            return f"{SUMS} unreadable ({type(e).__name__}: {e})"
        for name, (
            size,
            _,
        ) in want.items():  # sizes first: a truncated file is found without reading it
            if (got := (path / name).stat().st_size) != size:
                return f"{name} is {got} bytes, {size} when written (truncated?)"
        for name, (_, digest) in want.items():
            if sha256_file(path / name) != digest:
                return f"{name}: sha256 differs from the one recorded when it was written"
        return None
    for name, load in (
        ("drafter.json", lambda p: json.loads(p.read_text())["fingerprint"]),
        ("model.safetensors", lambda p: load_file(str(p))),
        ("trainer_state.pt", lambda p: torch.load(p, map_location="cpu", weights_only=False)),
    ):
        try:
            load(path / name)
        except Exception as e:  # noqa: BLE001 - whatever the loader says, the file is what failed
            return f"{name} does not load ({type(e).__name__}: {e})"
    return None


def quarantine(path: Path) -> Path:
    """Move a damaged checkpoint out of the way, to output_dir/checkpoints.quarantine/ (never
    deleted: the operator may want to look at it); an earlier quarantined one of the same name stays
    too."""
    root = quarantine_dir(path.parent.parent)
    root.mkdir(parents=True, exist_ok=True)
    dest, k = root / path.name, 1
    while dest.exists():
        dest, k = root / f"{path.name}.{k}", k + 1
    os.replace(path, dest)
    return dest


def resumable_checkpoint(
    output_dir: Path, warn, quarantined: list[dict] | None = None
) -> Path | None:
    """The newest intact checkpoint of output_dir (None: none left, so training starts from step 0,
    as with no checkpoints). Each damaged newer one is named through `warn`, quarantined, and
    appended to `quarantined` ({"checkpoint", "moved_to", "why"}: report.json's record).

    Under torch.distributed rank 0 checks and moves, the others get its answer (every rank must
    resume from the same checkpoint)."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    found: Path | None = None
    if rank == 0:
        candidates = sorted((Path(output_dir) / "checkpoints").glob("step-[0-9]*"))
        for path in reversed(candidates):
            why = damage(path)
            if why is None:
                found = path
                break
            moved = quarantine(path)
            if quarantined is not None:
                quarantined.append({"checkpoint": str(path), "moved_to": str(moved), "why": why})
            warn(
                f"checkpoint {path} is damaged: {why}; moved to {moved}, resuming from the newest "
                f"intact one"
            )
        if candidates and found is None:
            warn(
                f"no intact checkpoint left in {Path(output_dir) / 'checkpoints'} (the damaged "
                f"ones are in {quarantine_dir(output_dir)}): training starts from step 0"
            )
    if dist.is_initialized():
        box = [None if found is None else str(found)]
        dist.broadcast_object_list(box, src=0)
        found = None if box[0] is None else Path(box[0])
    return found


def checkpoint_differs(path: Path, fingerprint: dict, *, can_warm_start: bool = False) -> list[str]:
    """The fingerprint fields in which the checkpoint's run differs from this one ([]: resumable).

    Differing and no warm start configured: refused, naming training.init_from (the way to train on
    from those weights with other data or settings)."""
    differ = _differ(json.loads((path / "drafter.json").read_text())["fingerprint"], fingerprint)
    if differ and not can_warm_start:
        raise InvalidInput(refusal(path, differ))
    return differ


LATER_KEYS = frozenset(
    {"data_sha256"}
)  # fingerprint keys a checkpoint written before eyas recorded them lacks


def _differ(old: dict, new: dict) -> list[str]:
    return sorted(
        k
        for k in set(old) | set(new)
        if k != "max_steps" and old.get(k) != new.get(k) and not (k in LATER_KEYS and k not in old)
    )


def refusal(path: Path, differ: list[str]) -> str:
    return (
        f"{path}: checkpoint is from a different run ({', '.join(differ)} differ), so it "
        f"cannot be resumed. "
        f"To train on from its weights (new data, say), set training.init_from to that run's "
        f"exported drafter (the pipeline's run_dir/drafter) or to a copy of {path} outside "
        f"training.output_dir: a "
        f"warm start (its weights and draft vocabulary, a fresh optimizer and schedule from "
        f"step 0; the "
        f"old checkpoints are set aside to {path.parent}.previous/). To start over, remove "
        f"{path.parent} or use another training.output_dir"
    )


def _state_dicts(objective, opt):
    """Full (unsharded) model and optimizer state dicts; collective under FSDP, keys without
    'drafter.'."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
    model = get_model_state_dict(objective, options=opts)
    model = {
        k.removeprefix("drafter."): v
        for k, v in model.items()
        if k != "drafter.embed_tokens.weight"
    }
    return model, get_optimizer_state_dict(objective, opt, options=opts)


def save_checkpoint(
    output_dir: Path,
    objective,
    opt,
    sched,
    state: TrainState,
    info: dict,
    *,
    rank: int = 0,
    keep: int = 2,
    ema=None,
) -> Path:
    """Write checkpoints/step-NNNNNN whole in a temp folder, then rename it into place (rank 0
    writes)."""
    model_sd, opt_sd = _state_dicts(objective, opt)
    ema_sd = (
        ema.state_dict(keep=rank == 0) if ema is not None else None
    )  # collective under FSDP, as above
    root = output_dir / "checkpoints"
    final = root / f"step-{state.step:06d}"
    if rank == 0:
        with atomic_dir(final) as tmp:  # fsynced, then renamed into place whole
            save_file(
                {k: v.detach().contiguous().cpu() for k, v in model_sd.items()},
                str(tmp / "model.safetensors"),
            )
            (tmp / "drafter.json").write_text(json.dumps(info, indent=2, sort_keys=True) + "\n")
            rng = {
                "torch": torch.get_rng_state(),
                "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
            }
            torch.save(
                {
                    "optimizer": opt_sd,
                    "scheduler": sched.state_dict(),
                    "state": asdict(state),
                    "rng": rng,
                    "fingerprint": info["fingerprint"],
                    "ema": ema_sd,
                },
                tmp / "trainer_state.pt",
            )
            # The files as written, read back: a later truncation or overwrite is found before a
            # resume
            sums = {
                name: {"bytes": (tmp / name).stat().st_size, "sha256": sha256_file(tmp / name)}
                for name in FILES
            }
            (tmp / SUMS).write_text(
                json.dumps({"format": SUMS_FORMAT, "files": sums}, indent=2, sort_keys=True) + "\n"
            )
        for old in sorted(root.glob("step-[0-9]*"))[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
    if dist.is_initialized():
        dist.barrier()
    return final


def load_checkpoint(
    path: Path, objective, opt, sched, fingerprint: dict, log, ema=None
) -> TrainState:
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    # resumable_checkpoint checked the bytes; a failure here is not damage (another torch, say)
    try:
        ckpt = torch.load(path / "trainer_state.pt", map_location="cpu", weights_only=False)
    except Exception as e:
        raise InvalidInput(
            f"{path / 'trainer_state.pt'}: checkpoint does not load ({type(e).__name__}: {e})"
        ) from e
    old = ckpt["fingerprint"]
    differ = _differ(old, fingerprint)
    if differ:
        raise InvalidInput(refusal(path, differ))
    if old.get("max_steps") != fingerprint.get("max_steps"):
        log(
            f"resuming with max_steps {fingerprint['max_steps']} (checkpoint ran with "
            f"{old['max_steps']})"
        )
    try:
        weights = load_file(str(path / "model.safetensors"))
    except Exception as e:
        raise InvalidInput(
            f"{path / 'model.safetensors'}: checkpoint does not load ({type(e).__name__}: {e})"
        ) from e
    opts = StateDictOptions(full_state_dict=True, strict=False)
    result = set_model_state_dict(
        objective, {"drafter." + k: v for k, v in weights.items()}, options=opts
    )
    missing = [k for k in result.missing_keys if k != "drafter.embed_tokens.weight"]
    if missing or result.unexpected_keys:
        raise InvalidInput(
            f"{path}: checkpoint weights do not fit the drafter (missing {missing}, "
            f"unexpected {result.unexpected_keys})"
        )
    set_optimizer_state_dict(
        objective, opt, ckpt["optimizer"], options=StateDictOptions(full_state_dict=True)
    )
    sched.load_state_dict(ckpt["scheduler"])
    if ema is not None:
        if ckpt.get("ema") is None:
            raise InvalidInput(
                f"{path}: checkpoint holds no weight average, but training.ema_decay is set"
            )
        ema.load_state_dict(ckpt["ema"], str(path))
    torch.set_rng_state(ckpt["rng"]["torch"])
    if ckpt["rng"]["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(ckpt["rng"]["cuda"])
    return TrainState(**ckpt["state"])
