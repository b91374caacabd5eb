"""An exponential moving average of the drafter's trainable weights (training.ema_decay).

    ema = WeightEMA(named_trainable_params, decay=0.995)
    ema.update(step)             # after every optimizer step (step: the steps taken before it)
    # at max_steps: the average becomes the weights evaluated and exported
    ema.swap()

Why: late in training each step still moves the weights by lr times a noisy gradient, so the last
step's weights are one sample around where training settled; their average over the last
~1/(1-decay) steps sits nearer the middle. On the embedded default it raised three seeds' mean
acceptance length by 0.02 (bench/results/2026-12-05_cpu2_quality-ema.md).

The average is bias-corrected as Adam's moments are: after t steps it is sum_i decay**(t-i) w_i over
sum_i decay**(t-i), the trained weights only, never the starting ones (the step's rate
1 - (1 - decay) / (1 - decay**t) is 0 at the first step and tends to `decay`). A short run is not
pulled back to its initialisation, and a long one is the plain moving average.

`swap()` exchanges the weights and the average, so it is its own inverse: the final checkpoint holds
the average as its weights (what export reads) and the raw weights in its trainer state; a run
resumed past its old max_steps swaps back and trains on from the raw weights (and a mid-run
checkpoint resumed with a max_steps at or below its step is swapped and written again). Under FSDP
the weights are DTensors: the average is sharded like them, and state_dict() gathers it (a
collective: every rank calls it).
"""

from __future__ import annotations

import torch

from eyas.errors import InvalidInput


class WeightEMA:
    def __init__(self, params: dict[str, torch.nn.Parameter], decay: float):
        if not 0.0 < decay < 1.0:
            raise InvalidInput(f"training.ema_decay must be in (0, 1), got {decay}")
        self.params, self.decay = params, decay
        self.average = {n: p.detach().clone() for n, p in params.items()}
        self.swapped = False  # True: the weights hold the average, self.average the raw weights

    def rate(self, step: int) -> float:
        """How much of the average is kept at the step after `step` steps were taken."""
        return 1.0 - (1.0 - self.decay) / (1.0 - self.decay ** (step + 1))

    @torch.no_grad()
    def update(self, step: int) -> None:
        if self.swapped:
            raise RuntimeError("WeightEMA.update after swap(): swap back before training on")
        w = 1.0 - self.rate(step)
        for n, p in self.params.items():
            self.average[n].lerp_(p.detach(), w)

    @torch.no_grad()
    def swap(self) -> None:
        for n, p in self.params.items():
            raw = p.detach().clone()
            p.copy_(self.average[n])
            self.average[n] = raw
        self.swapped = not self.swapped

    def state_dict(self, keep: bool = True) -> dict | None:
        """Full (gathered) tensors on the CPU; collective under FSDP. keep=False (the ranks that do
        not write the checkpoint): gathered, as every rank must, and dropped at once -> None."""
        average = {}
        for n, t in self.average.items():
            t = (
                t.full_tensor() if hasattr(t, "full_tensor") else t
            )  # a DTensor shard, or a whole tensor
            if keep:
                average[n] = t.detach().cpu()
        return {"swapped": self.swapped, "average": average} if keep else None

    def load_state_dict(self, sd: dict, where: str) -> None:
        names = set(sd["average"])
        if names != set(self.params):
            raise InvalidInput(
                f"{where}: its weight average holds {sorted(names ^ set(self.params))} "
                f"that this drafter's trainable weights do not (or the other way round)"
            )
        for n, p in self.params.items():
            t = sd["average"][n].to(p.device, p.dtype)
            if hasattr(p, "device_mesh"):  # a DTensor shard (FSDP): the average is sharded alike
                from torch.distributed.tensor import distribute_tensor

                t = distribute_tensor(t, p.device_mesh, p.placements)
            self.average[n] = t
        self.swapped = bool(sd["swapped"])
