"""What one optimizer step reports: StepStats, handed to train_drafter's `on_step` after every step.

    def on_step(s: StepStats):                     # cheap: called every step, on rank 0 only
        print(s.percent, s.tokens_per_s, s.eta_s, s.row())

Prefect-free: the task layer throttles what reaches the UI (tasks/progress.py). The run's bounded
loss table (`TrainResult.history`, report.json's `training.history`) keeps the rows of the steps
`in_history` marks: about HISTORY_ROWS of them evenly spaced, every held-out evaluation, the last.
Under torchrun, rank 0 appends every StepStats as a JSON line to `launch/progress.jsonl`, which the
launcher tails (eyas/training/distributed.py).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

HISTORY_ROWS = (
    100  # rows of the loss table, evenly spaced over max_steps (plus evaluations, the last)
)


@dataclass(frozen=True)
class StepStats:
    step: int  # optimizer steps done (resumed ones included)
    max_steps: int
    loss: float  # this step's loss over the global batch
    accuracies: tuple[float, ...]  # this step's accuracy per TTT step
    lr: float  # the learning rate this step used
    tokens: int  # sequence tokens trained on so far (resumed ones included)
    seconds: float  # wall seconds since this call's first step began
    start_step: int = 0  # the step this call started from (a resume's checkpoint)
    start_tokens: int = 0  # tokens at start_step
    heldout_acceptance: float | None = (
        None  # simulated acceptance length, when evaluated at this step
    )
    in_history: bool = False  # this step's row belongs to the run's loss table

    @property
    def percent(self) -> float:
        return round(100.0 * self.step / max(self.max_steps, 1), 2)

    @property
    def tokens_per_s(self) -> float | None:
        """Over this call's steps (a resume's earlier steps ran at another time)."""
        return (
            round((self.tokens - self.start_tokens) / self.seconds, 1) if self.seconds > 0 else None
        )

    @property
    def eta_s(self) -> float | None:
        """None until two steps of this call ran: the first one's time is mostly set-up and
        compiling."""
        done = self.step - self.start_step
        return round((self.max_steps - self.step) * self.seconds / done, 1) if done > 1 else None

    def row(self) -> dict:
        """One row of the loss table: step, loss, accuracy per TTT step, lr, tokens/s, held-out."""
        return {
            "step": self.step,
            "loss": round(self.loss, 5),
            **{f"acc_{k}": round(a, 4) for k, a in enumerate(self.accuracies)},
            "lr": float(f"{self.lr:.4g}"),
            "tokens_per_s": self.tokens_per_s,
            "heldout_acceptance": None
            if self.heldout_acceptance is None
            else round(self.heldout_acceptance, 4),
        }

    def describe(self) -> str:
        acc = " ".join(f"{a:.2f}" for a in self.accuracies)
        rate = f"{self.tokens_per_s:,.0f} tok/s" if self.tokens_per_s else "- tok/s"
        eta = f"ETA {self.eta_s:.0f}s" if self.eta_s is not None else "ETA -"
        return (
            f"step {self.step}/{self.max_steps}, loss {self.loss:.4f}, acc [{acc}], {rate}, {eta}"
        )

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, d: dict) -> "StepStats":
        return cls(**{**d, "accuracies": tuple(d["accuracies"])})


def history_every(max_steps: int) -> int:
    return max(1, -(-max_steps // HISTORY_ROWS))


def keeps_row(step: int, max_steps: int, *, evaluated: bool, last: bool) -> bool:
    """Whether step's row goes into the bounded loss table."""
    return step % history_every(max_steps) == 0 or evaluated or last


def simulated_acceptance_length(per_step_acc) -> float:
    """Chain acceptance length predicted from per-TTT-step accuracies: 1 + sum_k prod_{i<=k} acc_i.

    The leading 1 is the target's bonus token, so this compares with evaluation's
    `acceptance_length`.
    """
    total, run = 1.0, 1.0
    for a in per_step_acc:
        run *= float(a)
        total += run
    return total
