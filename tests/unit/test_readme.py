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
