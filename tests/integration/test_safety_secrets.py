"""Issue 16.3: secrets reach the server process and nothing else.

The extract flow runs (as `eyas run` runs it: a loaded config plus overrides) against a real Prefect
server with its own PREFECT_HOME, on a config file holding three canaries: a `server.secret_env`
value, a worker variable copied by `server.env_from`, and an `--api-key` in `server.launch_args`
(eyas-local enforces it as SGLang does, so extraction only works if the clients send it). The server
process must get all three; the Prefect database and result storage, the run's outputs, the server's
log and the worker's console must hold none of them.
"""

import json
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest
import yaml

from tests.prefect_server import start_prefect_server
from tests.stage_config import ROOT, stage_config

pytestmark = pytest.mark.slow

DRIVER = """
import sys
from eyas.config import load_config
from eyas_prefect.flows.extract import extract

extract(load_config(sys.argv[1]), overrides={"extraction.num_shards": 1})
print("extract done")
"""


def _files(*roots: Path):
    for root in roots:
        if root.is_file():
            yield root
        elif root.is_dir():
            yield from (p for p in root.rglob("*") if p.is_file() and not p.is_symlink())


def _watch_server(workdir: Path, seen: dict, stop: threading.Event) -> None:
    """Read the launched server's environment and argv from /proc while it runs."""
    while not stop.is_set():
        try:
            pid = json.loads((workdir / "server.pid").read_text())["pid"]  # the launch record
            seen["environ"] = dict(
                e.split(b"=", 1)
                for e in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
                if e
            )
            seen["argv"] = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            if b"eyas.local.server" in b" ".join(seen["argv"]) or b"serve-local" in b" ".join(
                seen["argv"]
            ):
                return
        except (OSError, ValueError):
            pass
        time.sleep(0.02)


def test_canaries_reach_the_server_and_nowhere_else(tmp_path):
    canary = {k: f"canary-{k}-{uuid.uuid4().hex}" for k in ("secret", "worker", "apikey")}
    data = tmp_path / "conversations.jsonl"
    lines = (ROOT / "fixtures" / "data" / "conversations.jsonl").read_text().splitlines()[:6]
    data.write_text("\n".join(lines) + "\n")
    cfg = stage_config(
        tmp_path,
        ROOT / "fixtures" / "tiny-target",
        **{
            "data.path": str(data),
            "data.num_heldout": 2,
            "data.max_length": 128,
            "extraction.num_shards": 2,
            "server.chunked_prefill_size": 64,
            "server.launch_args": ["--load-delay", "0.2"],
            "training.batch_size": 2,
        },
    )  # preflight: a global batch must fit the 4 training sequences
    raw = cfg.model_dump(mode="json")
    raw["server"]["secret_env"] = {"EYAS_SECRET": canary["secret"]}
    raw["server"]["env_from"] = {"EYAS_FROM_WORKER": "EYAS_TEST_WORKER_TOKEN"}
    raw["server"]["launch_args"] += ["--api-key", canary["apikey"]]
    config_file = tmp_path / "on-the-worker" / "eyas.yaml"  # a config file kept on the worker
    config_file.parent.mkdir()
    config_file.write_text(yaml.safe_dump(raw))
    driver = tmp_path / "on-the-worker" / "driver.py"
    driver.write_text(DRIVER)

    (tmp_path / "prefect-home").mkdir()
    prefect = start_prefect_server(tmp_path / "prefect-home")
    seen: dict = {}
    stop = threading.Event()
    watcher = threading.Thread(
        target=_watch_server, args=(cfg.server.workdir, seen, stop), daemon=True
    )
    watcher.start()
    try:
        env = {
            **prefect.env,
            "PYTHONPATH": str(ROOT),
            "OMP_NUM_THREADS": "1",
            "EYAS_TEST_WORKER_TOKEN": canary["worker"],
        }
        run = subprocess.run(
            [sys.executable, str(driver), str(config_file)],
            cwd=ROOT,
            env=env,
            text=True,
            capture_output=True,
            timeout=600,
        )
        assert run.returncode == 0 and "extract done" in run.stdout, (run.stdout + run.stderr)[
            -4000:
        ]
        flow_runs = prefect.post("/flow_runs/filter", {"limit": 50})
    finally:
        stop.set()
        prefect.stop()
    watcher.join(5)

    # The server got every secret, exactly.
    assert seen.get("environ", {}).get(b"EYAS_SECRET") == canary["secret"].encode()
    assert seen["environ"].get(b"EYAS_FROM_WORKER") == canary["worker"].encode()
    assert seen["argv"][seen["argv"].index(b"--api-key") + 1] == canary["apikey"].encode()
    assert (
        len(list((tmp_path / "shards").glob("shard-*.safetensors"))) == 1
    )  # the keyed requests worked

    # Prefect recorded the parameters, masked.
    extract_run = next(r for r in flow_runs if r["parameters"].get("overrides"))
    server = extract_run["parameters"]["config"]["server"]
    assert server["secret_env"] == {"EYAS_SECRET": "**********"}
    assert server["env_from"] == {"EYAS_FROM_WORKER": "EYAS_TEST_WORKER_TOKEN"}
    assert server["launch_args"][-2:] == ["--api-key", "***"]

    # Nothing else holds them: the database, result storage, outputs, server log, console.
    (tmp_path / "console.txt").write_text(run.stdout + run.stderr)
    places = [
        tmp_path / "prefect-home",
        tmp_path / "run",
        tmp_path / "shards",
        tmp_path / "server",
        tmp_path / "console.txt",
    ]
    checked = list(_files(*places))
    assert any(p.name == "prefect.db" for p in checked) and any(
        p.name == "server.log" for p in checked
    )
    for path in checked:
        blob = path.read_bytes()
        for name, value in canary.items():
            assert value.encode() not in blob, f"the {name} canary is in {path}"
    assert "launched pid" in run.stdout + run.stderr and "--api-key ***" in run.stdout + run.stderr
