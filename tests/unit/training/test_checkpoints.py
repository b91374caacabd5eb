"""Damaged training checkpoints: named, quarantined, skipped; training resumes from the newest
intact one."""

import json
import os
import re

import pytest
import torch
from safetensors.torch import load_file

from eyas.training.checkpoints import SUMS, damage, quarantine
from eyas.training.train import train_drafter
from tests.helpers_training import target_config, training_config

torch.set_num_threads(1)


def quiet(_):
    pass


@pytest.fixture(scope="module")
def uninterrupted(sharp_target, shards, tmp_path_factory):
    """9 steps in one go: what every resumed run below must reproduce bit for bit."""
    return train_drafter(
        training_config(tmp_path_factory.mktemp("full"), max_steps=9, checkpoint_every=3),
        target_config(sharp_target),
        shards,
        log=quiet,
    )


def truncate(path, keep=0.5):
    size = path.stat().st_size
    with open(path, "r+b") as f:
        f.truncate(int(size * keep))


def flip_a_byte(path):
    with open(path, "r+b") as f:
        f.seek(path.stat().st_size // 2)
        b = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([b[0] ^ 0xFF]))


@pytest.mark.parametrize(
    "fault", ["truncated-trainer-state", "flipped-weight-byte", "truncated-legacy"]
)
def test_a_damaged_latest_checkpoint_is_quarantined_and_training_resumes_from_the_one_before(
    sharp_target, shards, tmp_path, uninterrupted, fault
):
    """Checkpoints at 3 and 6, the one at 6 damaged: the re-run names it, moves it to
    checkpoints.quarantine/ and resumes from 3, giving the uninterrupted run's losses and weights.
    truncated-legacy: checkpoints written before checksums existed (no checksums.json) still resume;
    a damaged one is found because it does not load."""
    tgt, out = target_config(sharp_target), tmp_path / "t"
    cfg = training_config(out, max_steps=9, checkpoint_every=3)
    part = train_drafter(cfg, tgt, shards, log=quiet, stop_at_step=6)
    assert part.steps == 6
    ckpts = out / "checkpoints"
    assert sorted(p.name for p in ckpts.iterdir()) == ["step-000003", "step-000006"]
    sums = json.loads((ckpts / "step-000006" / SUMS).read_text())["files"]
    assert set(sums) == {"model.safetensors", "drafter.json", "trainer_state.pt"}
    bad = ckpts / "step-000006"
    if fault == "truncated-trainer-state":
        truncate(bad / "trainer_state.pt")
        why = r"trainer_state.pt is \d+ bytes, \d+ when written \(truncated\?\)"
    elif fault == "flipped-weight-byte":
        flip_a_byte(bad / "model.safetensors")
        why = "model.safetensors: sha256 differs from the one recorded when it was written"
    else:
        for step in ("step-000003", "step-000006"):
            (ckpts / step / SUMS).unlink()
        truncate(bad / "trainer_state.pt")
        why = r"trainer_state.pt does not load \(RuntimeError: .*zip archive"
    logs, warnings = [], []
    resumed = train_drafter(cfg, tgt, shards, log=logs.append, warn=warnings.append)
    named = [line for line in warnings if line.startswith(f"checkpoint {bad} is damaged")]
    assert (
        len(named) == 1 and f"moved to {out / 'checkpoints.quarantine' / 'step-000006'}" in named[0]
    ), logs
    assert re.search(why, named[0]), named[0]
    assert len(warnings) == 1 and not any(line.startswith("checkpoint ") for line in logs)
    # report.json's training.quarantined
    [q] = resumed.quarantined
    assert q["checkpoint"] == str(bad) and re.search(why, q["why"]), q
    assert q["moved_to"] == str(out / "checkpoints.quarantine" / "step-000006")
    assert (
        out / "checkpoints.quarantine" / "step-000006" / "trainer_state.pt"
    ).exists()  # kept for a look
    assert resumed.resumed_from_step == 3 and any(line.startswith("resumed from") for line in logs)
    assert resumed.losses == uninterrupted.losses  # bit for bit, as a resume from 3 always was
    wa = load_file(f"{uninterrupted.checkpoint_dir}/model.safetensors")
    wb = load_file(f"{resumed.checkpoint_dir}/model.safetensors")
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    assert damage(ckpts / "step-000009") is None  # the new ones carry checksums again


def test_no_intact_checkpoint_left_starts_from_step_0_saying_so(
    sharp_target, shards, tmp_path, uninterrupted
):
    tgt, out = target_config(sharp_target), tmp_path / "t"
    cfg = training_config(out, max_steps=9, checkpoint_every=3)
    train_drafter(cfg, tgt, shards, log=quiet, stop_at_step=3)
    truncate(out / "checkpoints" / "step-000003" / "model.safetensors")
    logs = []
    again = train_drafter(cfg, tgt, shards, log=logs.append)
    assert [line for line in logs if line.startswith("no intact checkpoint left")] == [
        f"no intact checkpoint left in {out / 'checkpoints'} (the damaged ones are in "
        f"{out / 'checkpoints.quarantine'}): training starts from step 0"
    ]
    assert again.resumed_from_step == 0 and again.losses == uninterrupted.losses


def test_quarantine_keeps_an_earlier_quarantined_checkpoint_of_the_same_step(tmp_path):
    root = tmp_path / "checkpoints"
    for k in range(2):
        (root / "step-000004").mkdir(parents=True)
        (root / "step-000004" / "drafter.json").write_text(str(k))
        quarantine(root / "step-000004")
    q = tmp_path / "checkpoints.quarantine"
    assert (q / "step-000004" / "drafter.json").read_text() == "0"
    assert (q / "step-000004.1" / "drafter.json").read_text() == "1"
    assert damage(q / "step-000004") == "model.safetensors, trainer_state.pt missing"
