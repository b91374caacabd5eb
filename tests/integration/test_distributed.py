"""Training under torchrun through the Host seam: two gloo processes on this machine's CPU."""

import json

import pytest
import torch
from safetensors.torch import load_file

from eyas.training.distributed import TrainingLaunchError, launch_training
from eyas.training.train import train_drafter
from tests.helpers_training import sharpen_target, target_config, training_config, write_shards

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def setup(random_target, tmp_path_factory):
    target = sharpen_target(random_target, tmp_path_factory.mktemp("sharp"))
    shards = write_shards(
        target, tmp_path_factory.mktemp("shards"), num_shards=2, per_shard=10, length=24
    )
    # ema_decay: the weight average is kept per rank (sharded under FSDP) and gathered for the
    # checkpoint
    one = train_drafter(
        training_config(
            tmp_path_factory.mktemp("one"),
            max_steps=5,
            batch_size=2,
            grad_accum=2,
            checkpoint_every=100,
            ema_decay=0.8,
        ),
        target_config(target),
        shards,
        log=lambda _: None,
    )
    return target, shards, one


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_two_processes_give_the_losses_of_one_with_the_same_global_batch(
    setup, tmp_path, free_port, strategy
):
    target, shards, one = setup
    # teacher_cache_gb: no whole labels cached, so the ranks remember the argmax's bit and share it
    cfg = training_config(
        tmp_path / "two",
        max_steps=5,
        batch_size=2,
        grad_accum=1,
        checkpoint_every=100,
        ema_decay=0.8,
        teacher_cache_gb=1e-6,
        distributed={"nproc_per_node": 2, "master_port": free_port, "strategy": strategy},
    )
    logs, steps = [], []
    two = launch_training(
        cfg, target_config(target), shards, log=logs.append, poll_s=0.2, on_step=steps.append
    )
    assert (two.world_size, two.global_batch, one.global_batch) == (2, 4, 4)
    # Rank 0's steps, through launch/progress.jsonl, as train_drafter hands them in one process.
    assert [s.step for s in steps] == [1, 2, 3, 4, 5] and steps[-1].loss == two.losses[-1]
    assert steps[-1].percent == 100.0 and steps[-1].heldout_acceptance == pytest.approx(
        two.simulated_acceptance_length
    )
    assert two.history[-1]["step"] == 5 and two.history[-1]["loss"] == round(two.losses[-1], 5)
    assert two.losses == pytest.approx(one.losses, rel=1e-4, abs=1e-6)
    assert sum(two.accuracies, []) == pytest.approx(sum(one.accuracies, []), abs=1e-6)
    assert two.heldout_accuracies == pytest.approx(one.heldout_accuracies, abs=1e-6)
    assert any("global batch 4 (2 rank(s) x 1 x 2)" in line for line in logs), logs[:5]
    # rank 0 labelled half of the first epoch's sequences; after the epoch it knows every one of
    # them
    assert any(
        "epoch 2: the teacher's full-vocabulary argmax remembered for 16 of 20 sequences" in line
        for line in logs
    ), [line for line in logs if "epoch" in line]
    wa = load_file(f"{one.checkpoint_dir}/model.safetensors")
    wb = load_file(f"{two.checkpoint_dir}/model.safetensors")
    assert set(wa) == set(wb)
    for k in wa:  # the averages
        torch.testing.assert_close(wb[k], wa[k], rtol=1e-4, atol=1e-6)
    ra, rb = (
        torch.load(f"{r.checkpoint_dir}/trainer_state.pt", weights_only=False)["ema"]
        for r in (one, two)
    )
    assert ra["swapped"] and rb["swapped"] and set(ra["average"]) == set(rb["average"])
    for k in ra["average"]:  # the raw weights, gathered from the ranks' shards
        torch.testing.assert_close(rb["average"][k], ra["average"][k], rtol=1e-4, atol=1e-6)
    job = json.loads((tmp_path / "two" / "launch" / "job.json").read_text())
    assert job["training"]["distributed"]["strategy"] == strategy


def test_a_failing_node_is_reported_with_its_exit_code_and_log(setup, tmp_path, free_port):
    target, shards, _ = setup
    python = tmp_path / "broken-python"
    python.write_text("#!/bin/sh\necho 'no torch on this host' >&2\nexit 3\n")
    python.chmod(0o755)
    cfg = training_config(
        tmp_path / "bad",
        distributed={"nproc_per_node": 2, "master_port": free_port, "python": str(python)},
    )
    with pytest.raises(
        TrainingLaunchError,
        match=r"node 0: torchrun exited 3; see "
        r".*node-0.log\nno torch on this host",
    ):
        launch_training(cfg, target_config(target), shards, log=lambda _: None, poll_s=0.1)


def test_two_ranks_overlapped_loader_gives_the_gradients_of_the_synchronous_path(
    setup, tmp_path, free_port
):
    """Each rank's loader reads its own micro-batches (micro-batch j of a step: rank j % 2) ahead of
    the step; with training.loader_workers 0 the ranks collate them inside the step. Same losses,
    weights and AdamW moments (the gradients' running averages), bit for bit."""
    target, shards, _ = setup
    runs = {}
    for workers in (0, 2):
        cfg = training_config(
            tmp_path / f"w{workers}",
            max_steps=3,
            batch_size=2,
            grad_accum=2,
            checkpoint_every=100,
            loader_workers=workers,
            aux_noise=0.1,
            distributed={"nproc_per_node": 2, "master_port": free_port + workers},
        )
        runs[workers] = launch_training(
            cfg, target_config(target), shards, log=lambda _: None, poll_s=0.2
        )
    sync, overlapped = runs[0], runs[2]
    assert overlapped.world_size == 2 and overlapped.global_batch == 8
    assert overlapped.losses == sync.losses
    wa = load_file(f"{sync.checkpoint_dir}/model.safetensors")
    wb = load_file(f"{overlapped.checkpoint_dir}/model.safetensors")
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    sa, sb = (
        torch.load(f"{r.checkpoint_dir}/trainer_state.pt", weights_only=False)["optimizer"]["state"]
        for r in (sync, overlapped)
    )
    assert sa.keys() == sb.keys() and all(
        torch.equal(sa[i]["exp_avg"], sb[i]["exp_avg"]) for i in sa
    )
