"""Progress of long stages in the Prefect UI: a progress artifact, a table artifact, log lines.

Shared by the task files; publishing is throttled so thousands of shards (or steps) never flood the
API, and the UI being unreachable never stops the work.
"""

from __future__ import annotations

import threading
import time

from prefect.artifacts import create_progress_artifact, create_table_artifact, update_progress_artifact
from prefect.logging import get_logger, get_run_logger

from eyas.report import artifact_key

PUBLISH_EVERY_S = 2.0  # progress artifact and log line, at most this often while shards run
TABLE_EVERY_S = 30.0  # a new version of the shard table (500 rows in production), at most this often


def logger(name: str = "eyas"):
    """The run logger inside a run; a plain logger outside one (callbacks, cache-key functions)."""
    try:
        return get_run_logger()
    except Exception:  # noqa: BLE001 - outside a run context
        return get_logger(name)


class ExtractionPublisher:
    """Turns ExtractionRun updates into the `extract-NAME` progress artifact, the
    `extract-shards-NAME` table artifact and log lines."""

    def __init__(self, name: str):
        self.progress_key, self.table_key = artifact_key("extract", name), artifact_key("extract-shards", name)
        self.artifact_id = None
        self.last = self.last_table = 0.0
        self.lock = threading.Lock()
        self.warned = False

    def __call__(self, run, event: str) -> None:
        now = time.monotonic()
        with self.lock:
            if event == "progress" and now - self.last < PUBLISH_EVERY_S:
                return
            self.last = now
            table = event == "complete" or (event == "shard" and now - self.last_table >= TABLE_EVERY_S)
            if table:
                self.last_table = now
        figures, text = run.figures(), run.describe()
        log = logger("eyas.extract")
        log.info("extraction: %s", text)
        try:
            with self.lock:
                if self.artifact_id is None:
                    self.artifact_id = create_progress_artifact(
                        progress=figures["percent"], key=self.progress_key, description=text)
                else:
                    update_progress_artifact(artifact_id=self.artifact_id, progress=figures["percent"],
                                             description=text)
            if table:
                create_table_artifact(table=run.table(), key=self.table_key,
                                      description=f"extraction shards: {text}")
        except Exception as e:  # noqa: BLE001 - the UI is a view; extraction goes on without it
            if not self.warned:
                self.warned = True
                log.warning("extraction progress artifacts unavailable (%s: %s)", type(e).__name__, e)
