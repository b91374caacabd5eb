"""Progress of long stages in the Prefect UI: a progress artifact, a table artifact, log lines.

One throttled publisher (`Publisher`) behind the three stages that take long: extraction
(`extract-NAME`, `extract-shards-NAME`), regeneration (`regenerate-NAME`) and training
(`train-NAME`, `train-losses-NAME`). The core calls back as often as it likes (every sample,
conversation or step); the progress artifact is written at most every PUBLISH_EVERY_S and the table
at most every TABLE_EVERY_S (plus once at the end), so thousands of shards or steps never flood the
API, and the UI being unreachable never stops the work.
"""

from __future__ import annotations

import threading
import time
from typing import TYPE_CHECKING, Callable

from prefect.artifacts import (
    create_progress_artifact,
    create_table_artifact,
    update_progress_artifact,
)
from prefect.logging import get_logger, get_run_logger

from eyas.report import artifact_key

if TYPE_CHECKING:
    from eyas.training.train import TrainResult

PUBLISH_EVERY_S = 2.0  # the progress artifact (and its log line), at most this often
TABLE_EVERY_S = (
    30.0  # a new version of the table (500 shards, or ~100 loss rows), at most this often
)


def _run_logger():
    """The run logger of this thread's run context, or None."""
    try:
        return get_run_logger()
    except Exception:  # noqa: BLE001 - outside a run context
        return None


def logger(name: str = "eyas"):
    """The run logger inside a run; a plain logger outside one (callbacks, cache-key functions)."""
    return _run_logger() or get_logger(name)


class Publisher:
    """The progress artifact `STAGE-NAME` and, with `table`, the table artifact `TABLE-NAME` of one
    run.

    publish(figures, rows) is cheap when throttled: figures() -> (percent, text) and rows() -> table
    are only called when something is written. force: write the progress now; table: True = write
    the table now (when the progress is written), False = not this time, None = when due.
    log_every_s: a log line with the text at most this often (None: no log lines).
    """

    def __init__(
        self,
        stage: str,
        name: str,
        label: str,
        *,
        table: str | None = None,
        log_every_s: float | None = None,
    ):
        self.stage, self.label, self.log_every_s = stage, label, log_every_s
        self.progress_key = artifact_key(stage, name)
        self.table_key = artifact_key(table, name) if table else None
        self.artifact_id = None
        self.last = self.last_table = self.last_log = float("-inf")
        self.lock = threading.Lock()
        self.warned = False
        self.writes = 0  # progress artifact writes (creation included)
        # the run's logger where the publisher is made: its lines reach the run's log from threads
        # without a run context (a heartbeat) too
        self.log = logger(f"eyas.{stage}")

    def start(self, text: str) -> None:
        """Show the bar at 0 now, from the task's own thread: Prefect ties an artifact to the run it
        is created in, and callbacks from worker threads carry no run context (updates need
        none)."""
        self.publish(lambda: (0.0, text), force=True, table=False)

    def publish(
        self,
        figures: Callable[[], tuple[float, str]],
        rows: Callable[[], list[dict]] | None = None,
        *,
        force: bool = False,
        table: bool | None = None,
    ) -> bool:
        now = time.monotonic()
        with self.lock:
            if not force and now - self.last < PUBLISH_EVERY_S:
                return False
            self.last = now
            table = (
                rows is not None
                and self.table_key is not None
                and (now - self.last_table >= TABLE_EVERY_S if table is None else table)
            )
            if table:
                self.last_table = now
            log_now = self.log_every_s is not None and (
                force or now - self.last_log >= self.log_every_s
            )
            if log_now:
                self.last_log = now
        percent, text = figures()
        log = _run_logger() or self.log
        if log_now:
            log.info("%s: %s", self.label, text)
        try:
            with self.lock:
                if self.artifact_id is None:
                    self.artifact_id = create_progress_artifact(
                        progress=percent, key=self.progress_key, description=text
                    )
                else:
                    update_progress_artifact(
                        artifact_id=self.artifact_id, progress=percent, description=text
                    )
                self.writes += 1
            if table:
                create_table_artifact(
                    table=rows(), key=self.table_key, description=f"{self.label}: {text}"
                )
        except Exception as e:  # noqa: BLE001 - the UI is a view; the work goes on without it
            if not self.warned:
                self.warned = True
                log.warning(
                    "%s progress artifacts unavailable (%s: %s)", self.label, type(e).__name__, e
                )
        return True


class ExtractionPublisher:
    """ExtractionRun updates -> `extract-NAME`, the shard table `extract-shards-NAME`, log lines."""

    def __init__(self, name: str):
        self.out = Publisher("extract", name, "extraction", table="extract-shards", log_every_s=0.0)

    def __call__(self, run, event: str) -> None:  # events: "progress", "shard", "complete"
        self.out.publish(
            lambda: (run.figures()["percent"], run.describe()),
            run.table,
            force=event != "progress",
            table={"complete": True, "shard": None}.get(event, False),
        )


class RegenerationPublisher:
    """RegenerationProgress (every conversation, from worker threads) -> `regenerate-NAME`, a log
    line a minute. Made in the task, which it shows at 0 at once."""

    def __init__(self, name: str):
        self.out = Publisher("regenerate", name, "regeneration", log_every_s=60.0)
        self.out.start("starting")

    def __call__(self, p) -> None:
        self.out.publish(lambda: (p.percent, p.describe()), force=p.parts_done == p.num_parts)


class TrainingPublisher:
    """StepStats (every step) -> `train-NAME` (step/total, tokens/s, ETA) and `train-losses-NAME`
    (the loss table, newest step first: loss, accuracy per TTT step, lr, tokens/s, held-out
    acceptance). The core logs the steps."""

    def __init__(self, name: str, max_steps: int):
        self.out, self.max_steps = (
            Publisher("train", name, "training", table="train-losses"),
            max_steps,
        )
        self.rows: list[dict] = []
        self.out.start(f"starting: shards, drafter, target head (max_steps {max_steps})")

    def __call__(self, s) -> None:
        if s.in_history:
            self.rows.append(s.row())
        self.out.publish(lambda: (s.percent, s.describe()), lambda: self.rows[::-1])  # newest first

    def finish(self, result: TrainResult) -> None:
        """The end: the result's figures and its whole loss table (steps before a resume
        included)."""
        sal = result.simulated_acceptance_length
        text = (
            f"step {result.steps}/{self.max_steps}, final loss {result.final_loss:.4f}"
            + (f", held-out simulated acceptance {sal:.3f}" if sal is not None else "")
            + f", {result.tokens:,} tokens in {result.seconds:.0f}s"
        )
        self.out.publish(
            lambda: (round(100.0 * result.steps / self.max_steps, 2), text),
            lambda: result.history[::-1],
            force=True,
            table=True,
        )


class LaunchTally:
    """Where the serve-bench stage stands: which launches are up and how many prompts each has
    answered, against the plan (`planned`: the prompts each launch answers, every set and speed
    pass). Launches may run side by side (benchmark.interleave, .concurrent), so each is named by
    its own place in the order ("launch 1 of 2" is the plain server), and the share done counts
    every launch's answers: it only grows, whichever server answered last."""

    def __init__(self, keys: list[str]):
        self.keys, self.up = keys, []
        self.plan: dict[str, int] = {}
        self.answers = dict.fromkeys(keys, 0)

    def where(self, key: str) -> str:
        return f"launch {self.keys.index(key) + 1} of {len(self.keys)}"

    def answered(self, key: str) -> None:
        self.answers[key] += 1

    def share(self) -> float:
        """Prompts answered over prompts planned, 0..1; before the plan is known, launches up."""
        total = sum(self.plan.values())
        if not total:
            return max(0, len(self.up) - 1) / len(self.keys)
        return sum(min(self.answers[k], n) for k, n in self.plan.items()) / total


class ServeBenchPublisher:
    """The serve-bench stage -> `serve-launches-NAME` (`serve-bench-NAME` holds its results): which
    server is up (its launch of n), the prompts it has answered and its acceptance so far, the
    share of every launch's prompts answered, with a log line at most every LOG_EVERY_S. Made in
    the task, which it shows at 0 at once; told the prompts each launch will answer (`planned`),
    each launch's key as it is up (`launched`) and each answered prompt (`answered`):
    run_serve_bench's `progress`. A heartbeat republishes the state with the time spent every
    HEARTBEAT_S, so the artifact moves while one long request runs; `stop` (and `finish`) ends
    it."""

    LOG_EVERY_S = 15.0
    HEARTBEAT_S = 10.0

    def __init__(self, name: str, keys: list[str]):
        self.out = Publisher("serve-launches", name, "serve-bench", log_every_s=self.LOG_EVERY_S)
        self.tally, self.t0 = LaunchTally(keys), time.monotonic()
        self.state = f"launching the {keys[0]} server (1 of {len(keys)} launches)"
        self.out.start(self.state)
        self.stopped = threading.Event()
        threading.Thread(target=self._beat, name="serve-bench-progress", daemon=True).start()

    def planned(self, prompts: dict[str, int]) -> None:
        self.tally.plan = dict(prompts)

    def launched(self, key: str) -> None:
        self.tally.up.append(key)
        self.state = f"{key} server up and serving ({self.tally.where(key)})"
        self._publish(force=True)

    def answered(self, key: str, what: str, done: int, total: int, acceptance: float | None):
        """The `key` server answered `done` of `total` prompts of `what` (a prompt set, the speed
        pass); `acceptance`: its acceptance length so far (None on the plain server)."""
        self.tally.answered(key)
        so_far = "" if acceptance is None else f", acceptance {acceptance:.2f} so far"
        self.state = (
            f"{key} server ({self.tally.where(key)}): {what} {done}/{total} prompts{so_far}"
        )
        self._publish()

    def stop(self) -> None:
        """Stop the heartbeat (the stage ended, however)."""
        self.stopped.set()

    def finish(self) -> None:
        self.stop()
        n = len(self.tally.keys)
        self.out.publish(lambda: (100.0, f"{n} of {n} launches measured"), force=True)

    def _publish(self, force: bool = False) -> None:
        spent = time.monotonic() - self.t0
        percent = round(99.0 * self.tally.share(), 2)  # 100 once every figure is in (finish)
        text = f"{self.state}; {spent:.0f} s in"
        self.out.publish(lambda: (percent, text), force=force)

    def _beat(self) -> None:
        while not self.stopped.wait(self.HEARTBEAT_S):
            self._publish(force=True)
