import json
import shutil

import pytest
import torch
from safetensors.torch import load_file

from eyas.training.ema import WeightEMA
from eyas.training.train import train_drafter
from tests.helpers_training import target_config, training_config

torch.set_num_threads(1)


def quiet(_):
    pass


def test_the_average_is_bias_corrected_and_swap_is_its_own_inverse():
    w = torch.nn.Parameter(torch.zeros(3))
    ema = WeightEMA({"w": w}, decay=0.5)
    assert (
        ema.rate(0) == 0.0
        and ema.rate(1) == pytest.approx(1 / 3)
        and ema.rate(100) == pytest.approx(0.5)
    )
    for step, value in enumerate([1.0, 2.0, 4.0]):
        with torch.no_grad():
            w.fill_(value)
        ema.update(step)
    expected = torch.full(
        (3,), (0.25 * 1.0 + 0.5 * 2.0 + 1.0 * 4.0) / 1.75
    )  # the trained weights only
    assert torch.allclose(ema.average["w"], expected)
    ema.swap()
    assert ema.swapped and torch.allclose(w.detach(), expected)
    assert torch.equal(ema.average["w"], torch.full((3,), 4.0))
    with pytest.raises(RuntimeError, match="swap back"):
        ema.update(3)
    saved = ema.state_dict()
    other = WeightEMA({"w": torch.nn.Parameter(torch.zeros(3))}, decay=0.5)
    other.load_state_dict(saved, "ckpt")
    assert other.swapped and torch.equal(other.average["w"], ema.average["w"])
    ema.swap()
    assert not ema.swapped and torch.equal(w.detach(), torch.full((3,), 4.0))
    assert torch.allclose(ema.average["w"], expected)
    with pytest.raises(ValueError, match="ckpt: its weight average holds \\['v', 'w'\\]"):
        other.load_state_dict({**saved, "average": {"v": torch.zeros(3)}}, "ckpt")
    with pytest.raises(ValueError, match="ema_decay must be in"):
        WeightEMA({"w": w}, decay=1.0)


def _weights(result) -> dict[str, torch.Tensor]:
    return load_file(f"{result.checkpoint_dir}/model.safetensors")


def _raw(result) -> dict[str, torch.Tensor]:
    """The raw weights a finished EMA run keeps in its trainer state (the average is its
    weights)."""
    state = torch.load(f"{result.checkpoint_dir}/trainer_state.pt", weights_only=False)
    assert state["ema"]["swapped"]
    return {k.removeprefix("drafter."): v for k, v in state["ema"]["average"].items()}


def test_a_run_with_ema_exports_the_average_and_trains_exactly_as_without(
    sharp_target, shards, tmp_path
):
    tgt = target_config(sharp_target)
    plain = train_drafter(
        training_config(tmp_path / "a", max_steps=8, checkpoint_every=100), tgt, shards, log=quiet
    )
    ema = train_drafter(
        training_config(tmp_path / "b", max_steps=8, checkpoint_every=100, ema_decay=0.8),
        tgt,
        shards,
        log=quiet,
    )
    assert ema.losses == plain.losses  # the average never feeds back into training
    wa, wb, raw = _weights(plain), _weights(ema), _raw(ema)
    assert set(raw) <= set(wb) and all(
        torch.equal(raw[k], wa[k]) for k in raw
    )  # the last step's weights
    assert all(
        not torch.equal(wb[k], wa[k]) for k in raw
    )  # ... and the exported ones are the average
    fp = lambda r: json.loads(  # noqa: E731
        (tmp_path / r / "checkpoints" / "step-000008" / "drafter.json").read_text()
    )["fingerprint"]
    assert (
        "ema_decay" not in fp("a") and fp("b")["ema_decay"] == 0.8
    )  # off: older checkpoints still resume
    with pytest.raises(ValueError, match="ema_decay differ"):
        train_drafter(
            training_config(tmp_path / "a", max_steps=8, ema_decay=0.8), tgt, shards, log=quiet
        )


def test_an_interrupted_ema_run_resumes_exactly(sharp_target, shards, tmp_path):
    tgt = target_config(sharp_target)
    cfg = lambda d: training_config(tmp_path / d, max_steps=7, checkpoint_every=3, ema_decay=0.8)  # noqa: E731
    full = train_drafter(cfg("a"), tgt, shards, log=quiet)
    train_drafter(cfg("b"), tgt, shards, log=quiet, stop_at_step=5)
    shutil.rmtree(tmp_path / "b" / "checkpoints" / "step-000005")
    resumed = train_drafter(cfg("b"), tgt, shards, log=quiet)
    assert resumed.resumed_from_step == 3 and resumed.losses == full.losses
    wa, wb = _weights(full), _weights(resumed)
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    ra, rb = _raw(full), _raw(resumed)
    assert all(torch.equal(ra[k], rb[k]) for k in ra)


def test_a_finished_ema_run_trains_on_from_its_raw_weights(sharp_target, shards, tmp_path):
    """Resumed past its old max_steps, a run swaps the average back out: it trains on exactly as a
    run without the average would, and averages again from there."""
    tgt = target_config(sharp_target)
    for d, ema in (("a", 0.0), ("b", 0.8)):
        train_drafter(
            training_config(tmp_path / d, max_steps=5, checkpoint_every=100, ema_decay=ema),
            tgt,
            shards,
            log=quiet,
        )
    plain = train_drafter(
        training_config(tmp_path / "a", max_steps=8, checkpoint_every=100), tgt, shards, log=quiet
    )
    more = train_drafter(
        training_config(tmp_path / "b", max_steps=8, checkpoint_every=100, ema_decay=0.8),
        tgt,
        shards,
        log=quiet,
    )
    assert more.resumed_from_step == 5 and more.losses == plain.losses
    wa, raw = _weights(plain), _raw(more)
    assert all(torch.equal(raw[k], wa[k]) for k in raw)


def test_a_mid_run_checkpoint_finished_by_a_lower_max_steps_exports_the_average(
    sharp_target, shards, tmp_path
):
    tgt = target_config(sharp_target)
    full = train_drafter(
        training_config(tmp_path / "a", max_steps=3, checkpoint_every=100, ema_decay=0.8),
        tgt,
        shards,
        log=quiet,
    )
    cfg = lambda m: training_config(tmp_path / "b", max_steps=m, checkpoint_every=3, ema_decay=0.8)  # noqa: E731
    train_drafter(
        cfg(7), tgt, shards, log=quiet, stop_at_step=3
    )  # not swapped: the run was to go on
    done = train_drafter(cfg(3), tgt, shards, log=quiet)  # ... and is ended there instead
    assert done.resumed_from_step == 3 and done.checkpoint_dir.endswith("step-000003")
    # steps 1-3 take the same lr under either max_steps (warmup 2, then the peak): the same average
    # as a run of 3
    wa, wb, ra, rb = _weights(full), _weights(done), _raw(full), _raw(done)
    assert all(torch.allclose(wa[k], wb[k]) for k in ra) and all(
        torch.allclose(ra[k], rb[k]) for k in ra
    )
