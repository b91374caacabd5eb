"""The README's two commands are the project's promise; .ci/run must run the same test command."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _readme_commands() -> list[str]:
    return re.findall(r"```bash\n(.+?)\n```", (ROOT / "README.md").read_text())[:2]


def test_readme_opens_with_run_and_test_commands():
    run, test = _readme_commands()
    assert run.endswith("eyas run configs/local-tiny.yaml")
    assert "pytest" in test
    assert "torch==2.13.0" in run and "torch==2.13.0" in test  # else pip pulls a CUDA build


def test_ci_runs_the_readme_test_command():
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    assert _readme_commands()[1] in ci


def test_every_prefect_server_block_exports_the_api_url_and_analytics_before_starting_it():
    """The UI a `prefect server start` serves reads its API address from PREFECT_API_URL at start:
    on any port but 4200 it cannot reach its API when the export comes after; analytics off spares
    an offline server its telemetry errors."""
    for doc in ("README.md", "docs/operations.md", "docs/production.md"):
        for block in re.findall(r"```bash\n(.*?)```", (ROOT / doc).read_text(), re.S):
            lines = block.splitlines()
            starts = [i for i, line in enumerate(lines) if "prefect server start" in line]
            for i in starts:
                before = "\n".join(lines[:i])
                assert "export PREFECT_API_URL=" in before, (doc, lines[i])
                assert "export PREFECT_SERVER_ANALYTICS_ENABLED=false" in before, (doc, lines[i])
