"""Take the PNG of the Prefect UI that docs/operations.md shows: a pipeline run and its artifacts.

    PREFECT_API_URL=http://127.0.0.1:4200/api python deployments/screenshot.py [FLOW_RUN_ID] \
        [--out docs/images/prefect-pipeline-run.png]

Without FLOW_RUN_ID it takes the newest `eagle3-pipeline` run. Three pictures: the run page (state,
deployment and work pool, its subflow runs on the timeline with the report artifact, the logs);
beside it (`-artifacts.png`) the Artifacts page: the report, the loading, extraction, regeneration
and training progress, the shard table, the serving benchmark; and (`-training.png`) the newest
training loss table (`train-losses-NAME`: loss and per-TTT-step accuracy as training went).
`EYAS_UI_SCREENSHOT=docs/images/prefect-pipeline-run.png pytest
tests/integration/test_deployments.py` retakes it from the deployment tests' own server and pipeline
run. Needs Debian's chromium (`apt-get install -y chromium`); runs it headless with the flags this
sandboxed, offline machine needs.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import tempfile
import urllib.request
from pathlib import Path

FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--hide-scrollbars",
]


def newest_pipeline_run(api: str) -> str:
    body = json.dumps(
        {"flows": {"name": {"any_": ["eagle3-pipeline"]}}, "sort": "START_TIME_DESC", "limit": 1}
    ).encode()
    req = urllib.request.Request(
        f"{api}/flow_runs/filter", data=body, headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=10) as r:
        runs = json.loads(r.read())
    if not runs:
        raise SystemExit("no eagle3-pipeline flow run on this server")
    return runs[0]["id"]


def newest_artifact_id(api: str, prefix: str) -> str | None:
    body = json.dumps(
        {"artifacts": {"key": {"like_": f"{prefix}%"}}, "sort": "CREATED_DESC", "limit": 1}
    ).encode()
    req = urllib.request.Request(
        f"{api}/artifacts/filter", data=body, headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=10) as r:
        found = json.loads(r.read())
    return found[0]["id"] if found else None  # its page shows the table itself


def screenshot(url: str, out: Path, size: str = "1600,1000", wait_ms: int = 20000) -> Path:
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        raise SystemExit("chromium not found: apt-get install -y chromium")
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as profile:
        subprocess.run(
            [
                chromium,
                *FLAGS,
                f"--user-data-dir={profile}",
                f"--window-size={size}",
                f"--virtual-time-budget={wait_ms}",
                f"--screenshot={out.resolve()}",
                url,
            ],
            check=True,
            capture_output=True,
            timeout=120,
        )
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("flow_run_id", nargs="?")
    p.add_argument("--out", default="docs/images/prefect-pipeline-run.png")
    args = p.parse_args()
    api = os.environ.get("PREFECT_API_URL", "http://127.0.0.1:4200/api").rstrip("/")
    run_id = args.flow_run_id or newest_pipeline_run(api)
    ui, out = api.removesuffix("/api"), Path(args.out)
    print(screenshot(f"{ui}/runs/flow-run/{run_id}", out))
    print(screenshot(f"{ui}/artifacts", out.with_name(f"{out.stem}-artifacts.png")))
    losses = newest_artifact_id(api, "train-losses-")
    if losses:
        print(
            screenshot(
                f"{ui}/artifacts/artifact/{losses}", out.with_name(f"{out.stem}-training.png")
            )
        )


if __name__ == "__main__":
    main()
