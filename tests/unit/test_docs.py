"""The docs are reference, not a diary: docs/performance.md stays a page read in two minutes, and
dated records of runs live only under bench/results/<date>_<machine>_<what>.md. And they name only
what exists: every config field and `eyas` command they mention is the code's."""

import re
from pathlib import Path

from eyas.report import TRAINING_KEYS

ROOT = Path(__file__).resolve().parents[2]
PERFORMANCE = ROOT / "docs" / "performance.md"
MAX_PERFORMANCE_LINES = 250
DATE = re.compile(r"20\d\d-\d\d-\d\d")
# A results file's name holds its date: the one place a date may appear outside bench/results/.
RESULTS_PATH = re.compile(r"bench/results/[\w.+-]*\.md")
SKIP_PARTS = {"__pycache__", ".pytest_cache"}
SKIP_SUFFIXES = {".pyc", ".so", ".safetensors", ".bin", ".pt", ".npy", ".png", ".jpg", ".gz"}


def _texts():
    """(path, text) of docs/*.md and every text file under eyas/, tasks/, flows/ and configs/."""
    files = sorted((ROOT / "docs").glob("*.md"))
    for folder in ("eyas", "tasks", "flows", "configs"):
        files += sorted(
            p
            for p in (ROOT / folder).rglob("*")
            if p.is_file() and not SKIP_PARTS & set(p.parts) and p.suffix not in SKIP_SUFFIXES
        )
    for path in files:
        try:
            yield path, path.read_text()
        except UnicodeDecodeError:
            continue  # a binary fixture: no prose in it


def dates_outside_results_paths(text: str) -> list[str]:
    return DATE.findall(RESULTS_PATH.sub("", text))


def test_the_date_check_allows_a_results_path_and_nothing_else():
    assert dates_outside_results_paths("see bench/results/2026-12-05_h100_goal-rows.md") == []
    assert dates_outside_results_paths("[record](../bench/results/2026-12-05_cpu2_loader.md)") == []
    assert dates_outside_results_paths("measured 2026-12-05 on the H200") == ["2026-12-05"]
    assert dates_outside_results_paths("[2026-12-05](../bench/results/2026-12-05_x.md)") == [
        "2026-12-05"
    ]


def test_performance_page_fits_two_minutes():
    num_lines = len(PERFORMANCE.read_text().splitlines())
    assert num_lines <= MAX_PERFORMANCE_LINES, (
        f"docs/performance.md has {num_lines} lines, at most {MAX_PERFORMANCE_LINES}: move dated "
        f"records to "
        "bench/results/<date>_<machine>_<what>.md and link them"
    )


def test_no_date_outside_results_files():
    found = [
        f"{path.relative_to(ROOT)}:{n}: {line.strip()[:100]}"
        for path, text in _texts()
        for n, line in enumerate(text.splitlines(), 1)
        if dates_outside_results_paths(line)
    ]
    assert not found, "dates belong in bench/results/ files only:\n" + "\n".join(found)


def test_every_results_file_the_docs_link_exists():
    missing = [
        f"{path.relative_to(ROOT)}: {ref}"
        for path, text in _texts()
        for ref in RESULTS_PATH.findall(text)
        if not (ROOT / ref).is_file()
    ]
    assert not missing, "links to results files that do not exist:\n" + "\n".join(missing)


def test_the_first_screen_answers_how_fast_and_how_to_check():
    """The summary table (figure, goal, machine, commit, command) starts within the first 20
    lines."""
    head = PERFORMANCE.read_text().splitlines()[:20]
    assert any(
        re.match(
            r"\| what \| figure \| goal \| machine \| commit \| command "
            r"\|",
            line,
        )
        for line in head
    )


def test_the_runbooks_capture_launch_is_the_one_eyas_builds():
    """docs/production.md shows the Kimi capture launch whole: a hand-copied launch must be eyas's
    own."""
    from eyas.config import load_config
    from eyas.server.launch import capture_launch, launch_command

    text = (ROOT / "docs" / "production.md").read_text()
    shown = re.search(r"## 3\. The launches on this node.*?```\n(.+?)\n```", text, re.S)
    cfg = load_config(ROOT / "configs" / "kimi-k2.5-sglang.yaml")
    assert shown and shown.group(1) == launch_command(
        capture_launch(cfg), "KimiK25ForConditionalGeneration"
    )


# --- every config field and command the docs name exists -------------------------------------

#: report.json keys the docs name beside config fields of the same first word
REPORT_KEYS = {
    *(f"training.{k}" for k in TRAINING_KEYS),
    "extraction.tokens_per_s",
    "extraction.shards_reused",
    "extraction.relaunches",
}
FILE_NAME = re.compile(r"\.(pid|json|jsonl|log|py|yaml|md)$")


def config_field_exists(path: str) -> bool:
    """Whether a dotted name (`server.host.kind`) is a field of PipelineConfig, section by
    section."""
    import typing

    from eyas.config import PipelineConfig

    model = PipelineConfig
    for part in path.split("."):
        fields = getattr(model, "model_fields", None)
        if fields is None or part not in fields:
            return False
        ann = fields[part].annotation
        inner = [a for a in typing.get_args(ann) if hasattr(a, "model_fields")]
        model = ann if hasattr(ann, "model_fields") else (inner[0] if inner else None)
    return True


def task_exists(name: str) -> bool:
    """Whether a dotted name is a task of tasks/ (`server.launch_server`: tasks/server.py)."""
    import importlib

    module, _, attr = name.rpartition(".")
    try:
        return hasattr(importlib.import_module(f"eyas_prefect.tasks.{module}"), attr)
    except ImportError:
        return False


def docs_config_names() -> list[tuple[str, int, str]]:
    """(file, line, name) of every backticked dotted name in README.md and docs/ that starts with a
    config section."""
    from eyas.config import PipelineConfig

    names = re.compile(r"`((?:%s)(?:\.[A-Za-z_]\w*)+)`" % "|".join(PipelineConfig.model_fields))
    found = []
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for n, line in enumerate(path.read_text().splitlines(), 1):
            found += [(path.name, n, m.group(1)) for m in names.finditer(line)]
    return found


def test_every_config_field_the_docs_name_exists():
    found = docs_config_names()
    assert len(found) > 100  # the walk sees the docs' fields
    bad = [
        f"{f}:{n}: {name}"
        for f, n, name in found
        if not FILE_NAME.search(name)
        and name not in REPORT_KEYS
        and not config_field_exists(name)
        and not task_exists(name)
    ]
    assert not bad, "fields the config does not have:\n" + "\n".join(bad)


def test_the_field_check_refuses_a_field_that_is_not_there():
    assert config_field_exists("server.host.kind") and config_field_exists(
        "data.regenerate.thinking"
    )
    assert not config_field_exists("data.tokenizer") and not config_field_exists("server.nope")


def test_every_eyas_command_the_docs_name_exists():
    from eyas.cli import COMMANDS

    # run and worker: the Prefect layer's (flows/runtime/cli.py); make-tiny-target and serve-local:
    # parsers of eyas/cli.py's own
    commands = {c.name for c in COMMANDS} | {"run", "worker", "make-tiny-target", "serve-local"}
    named = set()
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        text = path.read_text()
        named |= set(re.findall(r"(?:`|\.venv/bin/)eyas ([a-z][a-z-]+)", text))
    assert named and named <= commands, f"commands eyas does not have: {sorted(named - commands)}"
