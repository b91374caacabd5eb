"""Warm start (training.init_from) and the per-step progress of train_drafter (core, no Prefect)."""

import pytest
import torch

from eyas.config import ExportConfig
from eyas.evaluation.export import export_drafter
from eyas.training.progress import HISTORY_ROWS
from eyas.training.train import train_drafter
from eyas.training.warm_start import draft_vocab
from tests.helpers_training import shard_meta, target_config, training_config, write_shards

torch.set_num_threads(1)


def quiet(_):
    pass


@pytest.fixture(scope="module")
def new_shards(sharp_target, tmp_path_factory):
    """The "next night's" data: other sequences of the same target."""
    return write_shards(
        sharp_target,
        tmp_path_factory.mktemp("new-shards"),
        num_shards=2,
        per_shard=12,
        length=40,
        seed=1,
    )


@pytest.fixture(scope="module")
def exported(sharp_target, shards, tmp_path_factory):
    """(the cold run's TrainResult, its exported drafter folder, its training output_dir)."""
    out = tmp_path_factory.mktemp("cold")
    cold = train_drafter(
        training_config(out / "train", max_steps=30, checkpoint_every=100),
        target_config(sharp_target),
        shards,
        log=quiet,
    )
    drafter = export_drafter(
        cold,
        out / "drafter",
        target=target_config(sharp_target),
        export=ExportConfig(dtype="bfloat16"),
        shard_meta=shard_meta(),
    )
    return cold, drafter, out / "train"


def test_on_step_reports_every_step_and_the_history_is_bounded(sharp_target, shards, tmp_path):
    steps = []
    cfg = training_config(
        tmp_path / "t",
        max_steps=2 * HISTORY_ROWS + 10,
        checkpoint_every=1000,
        eval_every=70,
        num_validation_sequences=4,
        batch_size=2,
    )
    r = train_drafter(cfg, target_config(sharp_target), shards, log=quiet, on_step=steps.append)
    assert [s.step for s in steps] == list(range(1, cfg.max_steps + 1))
    last = steps[-1]
    assert (
        last.percent == 100.0
        and last.loss == r.losses[-1]
        and list(last.accuracies) == r.accuracies[-1]
    )
    assert last.tokens == r.tokens and last.tokens_per_s > 0 and last.eta_s == 0.0
    assert last.heldout_acceptance == pytest.approx(r.simulated_acceptance_length)
    assert steps[0].lr < steps[30].lr  # warmup: the lr the step used
    # The loss table: every 3rd step (210 steps / 100 rows), the evaluations, the last; bounded.
    assert len(r.history) <= HISTORY_ROWS + 5 and [row["step"] for row in r.history][:3] == [
        3,
        6,
        9,
    ]
    assert r.history[-1]["step"] == cfg.max_steps and r.history[-1]["loss"] == round(
        r.losses[-1], 5
    )
    assert r.history[-1]["heldout_acceptance"] == round(r.simulated_acceptance_length, 4)
    assert [row["step"] for row in r.history if row["heldout_acceptance"] is not None] == [
        70,
        140,
        210,
    ]
    assert set(r.history[0]) == {
        "step",
        "loss",
        "acc_0",
        "acc_1",
        "acc_2",
        "lr",
        "tokens_per_s",
        "heldout_acceptance",
    }


def test_warm_start_from_an_exported_drafter_starts_lower_than_a_cold_start(
    sharp_target, shards, exported, tmp_path
):
    cold, drafter, _ = exported
    logs = []
    warm = train_drafter(
        training_config(tmp_path / "warm", max_steps=5, init_from=drafter, ttt_steps=4),
        target_config(sharp_target),
        shards,
        log=logs.append,
    )
    assert warm.first_loss < 0.7 * cold.first_loss, (warm.first_loss, cold.first_loss)
    assert (
        warm.steps == 5 and warm.resumed_from_step == 0
    )  # a new run: step, optimizer and schedule fresh
    assert warm.init_from == {"path": str(drafter), "kind": "drafter"}
    assert all(
        torch.equal(a, b) for a, b in zip(draft_vocab(warm.checkpoint_dir), draft_vocab(drafter))
    )
    assert any("its draft vocab covers" in line for line in logs)  # ttt_steps 4 against 3: allowed


def test_warm_start_from_a_checkpoint_and_a_mismatch_names_the_field(
    sharp_target, shards, exported, tmp_path
):
    cold, _, cold_dir = exported
    tgt = target_config(sharp_target)
    warm = train_drafter(
        training_config(tmp_path / "w", max_steps=2, init_from=cold_dir), tgt, shards, log=quiet
    )
    assert warm.init_from["kind"] == "checkpoint" and warm.first_loss < 0.7 * cold.first_loss
    with pytest.raises(
        ValueError,
        match=r"training\.draft_vocab_size gives draft_vocab_size=128 "
        r"in this run, 256",
    ):
        train_drafter(
            training_config(tmp_path / "v", draft_vocab_size=128, init_from=cold_dir),
            tgt,
            shards,
            log=quiet,
        )
    with pytest.raises(
        ValueError,
        match=r"training\.drafter\.intermediate_size gives "
        r"intermediate_size=64",
    ):
        train_drafter(
            training_config(tmp_path / "m", init_from=cold_dir, drafter={"intermediate_size": 64}),
            tgt,
            shards,
            log=quiet,
        )
    with pytest.raises(
        ValueError,
        match=r"training\.init_from=.*no model\.safetensors there.*it "
        r"does not exist",
    ):
        train_drafter(
            training_config(tmp_path / "x", init_from=tmp_path / "none"), tgt, shards, log=quiet
        )
    with pytest.raises(ValueError, match=r"training\.init_from=.*inside training\.output_dir"):
        train_drafter(
            training_config(cold_dir, init_from=cold_dir / "checkpoints"), tgt, shards, log=quiet
        )


def test_new_data_is_not_resumed_but_warm_started_with_the_old_checkpoints_set_aside(
    sharp_target, shards, new_shards, exported, tmp_path
):
    _, drafter, _ = exported
    tgt, out = target_config(sharp_target), tmp_path / "train"
    train_drafter(training_config(out, max_steps=3), tgt, shards, log=quiet)
    with pytest.raises(
        ValueError,
        match=r"different run \(data_sha256 differ\).*set "
        r"training\.init_from",
    ):
        train_drafter(training_config(out, max_steps=3), tgt, new_shards, log=quiet)
    # The nightly: init_from set, new shards. The old run's checkpoints go aside; this run starts at
    # 0.
    nightly, logs = training_config(out, max_steps=6, checkpoint_every=2, init_from=drafter), []
    part = train_drafter(nightly, tgt, new_shards, log=logs.append, stop_at_step=4)
    assert part.resumed_from_step == 0 and any("set aside to" in line for line in logs)
    assert sorted(p.name for p in (out / "checkpoints.previous").iterdir()) == ["step-000003"]
    # Killed mid-run and started again: its own checkpoints are resumed, nothing more is set aside.
    done = train_drafter(nightly, tgt, new_shards, log=quiet)
    assert done.resumed_from_step == 4 and done.steps == 6 and done.losses[:4] == part.losses
    assert sorted(p.name for p in (out / "checkpoints.previous").iterdir()) == ["step-000003"]
