"""The data side: the chat template (unless the data is pre-tokenized), and every bad line of
data.path counted and named with its column."""

from __future__ import annotations

import json
import shutil

from eyas.preflight import preflight
from eyas.preflight.data import has_chat_template
from tests.tiny_config import CONVERSATIONS, TINY, fields, tiny


def test_a_missing_chat_template_is_refused_unless_the_data_is_pre_tokenized(tmp_path):
    folder = (
        tmp_path / "tok"
    )  # a copy of the target's small files (target.local_dir) without a template
    folder.mkdir()
    shutil.copy(TINY / "tokenizer.json", folder)
    shutil.copy(TINY / "config.json", folder)
    raw = json.loads((TINY / "tokenizer_config.json").read_text())
    template = raw.pop("chat_template")
    (folder / "tokenizer_config.json").write_text(json.dumps(raw))
    r = preflight(tiny(tmp_path, **{"target.local_dir": str(folder)}))
    assert fields(r) == ["target.local_dir"] and "no chat template" in r.problems[0]
    tokens = tmp_path / "tokens.jsonl"
    tokens.write_text(
        "".join(
            json.dumps({"input_ids": [5, 6, 7, 8] * 10, "loss_mask": [0, 1] * 20}) + "\n"
            for _ in range(40)
        )
    )
    r = preflight(
        tiny(
            tmp_path,
            **{
                "target.local_dir": str(folder),
                "data.path": str(tokens),
                "data.regenerate.enabled": False,
            },
        )
    )
    assert r.ok, r.problems
    assert r.plan.data.tokens == 40 * (40 - 32) and any(
        "pre-tokenized" in n for n in r.notes
    )  # 32 held out
    (folder / "chat_template.jinja").write_text(template)  # the other place a template may live
    assert (
        has_chat_template(folder)
        and preflight(tiny(tmp_path, **{"target.local_dir": str(folder)})).ok
    )


def test_bad_data_is_a_problem_naming_the_line(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(CONVERSATIONS.read_text().splitlines()[0] + "\n{not json\n")
    r = preflight(tiny(tmp_path, **{"data.path": str(bad)}))
    assert (
        fields(r)[0] == "data.path"
        and f"{bad}:2:2: malformed JSON (Expecting property name" in r.problems[0]
    )
    r = preflight(tiny(tmp_path, **{"data.path": str(tmp_path / "missing.jsonl")}))
    assert fields(r) == ["data.path"] and "not found" in r.problems[0]


def test_every_bad_line_is_counted_and_the_first_20_named_with_their_columns(tmp_path):
    good = CONVERSATIONS.read_text().splitlines()
    bad_lines = ['{"messages": "tab\tin a string"}'] + ["{not json"] * 24 + ['{"messages": []}']
    bad = tmp_path / "bad.jsonl"
    bad.write_text("\n".join(good[:20] + bad_lines + good[20:40]) + "\n")
    r = preflight(tiny(tmp_path, **{"data.path": str(bad)}))
    [problem] = [p for p in r.problems if p.startswith("data.path")]
    assert "26 bad line(s)" in problem and "... and 6 more" in problem
    assert (
        f"{bad}:21:" in problem and "Invalid control character at column 18)" in problem
    )  # not cut short
    named = [line.strip() for line in problem.splitlines()[1:] if line.strip().startswith(str(bad))]
    assert len(named) == 20 and named[1].startswith(f"{bad}:22:2: malformed JSON")
    # skip mode: preflight passes and says what it will skip, counted
    r = preflight(tiny(tmp_path, **{"data.path": str(bad), "data.bad_lines": "skip"}))
    assert not [p for p in r.problems if p.startswith("data.path")]
    assert any("26 bad line(s)" in n and "data.bad_lines: skip drops them" in n for n in r.notes)
