"""docs/operations.md's Deploy block run as pasted: in order, as one script, on a fresh Prefect
home."""

import json
import os
import re
import shlex
import signal
import subprocess
import urllib.request

import pytest

from eyas.net import free_port
from tests.prefect_server import BIN, ROOT

pytestmark = pytest.mark.slow


def bash_block(doc: str, heading: str) -> str:
    """The first bash block after `heading` in a doc."""
    text = (ROOT / doc).read_text()
    return re.search(r"```bash\n(.*?)```", text[text.index(heading) :], re.S).group(1)


def test_the_deploy_block_runs_as_pasted_in_order(tmp_path):
    """docs/operations.md's Deploy block as one script, in order, on a fresh Prefect home: the
    operator's host, port and checkout substituted, the worker run for 20 s. The work pool is
    created right after the server starts, so the block must wait for it."""
    port = free_port()
    script = (
        bash_block("docs/operations.md", "### Deploy")
        .replace("http://prefect-host:4200", f"http://127.0.0.1:{port}")
        .replace("--host 0.0.0.0 --port 4200", f"--host 127.0.0.1 --port {port}")
        .replace("cd /srv/eyas", f"cd {shlex.quote(str(ROOT))}")
        .replace(".venv/bin/eyas worker", "timeout 20 .venv/bin/eyas worker")
        .replace(".venv/bin/", f"{BIN}/")
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    env.update(PREFECT_HOME=str(tmp_path), PWD=str(ROOT))
    bash = subprocess.Popen(
        ["bash", "-c", f"set -e\n{script}\n"],
        cwd=tmp_path,
        env=env,
        stdout=open(tmp_path / "block.log", "w"),  # the backgrounded server keeps it open
        stderr=subprocess.STDOUT,
        start_new_session=True,  # the backgrounded server: stopped with the group below
    )
    try:
        bash.wait(timeout=300)
        out = (tmp_path / "block.log").read_text()
        # the worker's 20 s end as `timeout` ends it (124); every line before it must succeed
        assert bash.returncode == 124, out[-4000:]
        req = urllib.request.Request(
            f"http://127.0.0.1:{port}/api/deployments/filter",
            data=b"{}",
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(req, timeout=10) as r:
            names = {d["name"] for d in json.loads(r.read())}
        assert {"pipeline", "nightly", "train", "extract"} <= names, names
    finally:
        try:
            os.killpg(bash.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
