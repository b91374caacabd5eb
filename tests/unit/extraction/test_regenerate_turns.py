"""A thinking target's turns, without a server: the template's switch, the reasoning span, and the
Kimi fixture's history rules."""

from __future__ import annotations

import pytest

from eyas.config import RegenerateConfig
from eyas.extraction.data import render_chat
from eyas.extraction.regenerate import pending_parts
from eyas.extraction.regenerate_turns import (
    RegenerationError,
    Thinking,
    split_reasoning,
    thinking_for,
)
from tests.thinking_target import kimi_template, write_tokenizer

TH = Thinking({"thinking": True}, start_id=8, end_id=9)


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    from transformers import AutoTokenizer

    folder = tmp_path_factory.mktemp("thinking-tokenizer")
    write_tokenizer(folder)
    return AutoTokenizer.from_pretrained(str(folder))


def test_the_reasoning_span_runs_from_the_opened_think_to_the_first_close():
    # The template opened <think> (thinking on): the reply reasons up to </think>, then answers.
    assert split_reasoning([4, 5, 8], [20, 21, 9, 30, 3], TH) == ([20, 21], [30, 3], True)
    # Cut by max_new_tokens inside its reasoning: all reasoning, unfinished.
    assert split_reasoning([4, 5, 8], [20, 21, 22], TH) == ([20, 21, 22], [], False)
    # The prompt ends in <think></think> (thinking off): an answer, even if it spells </think>
    # later.
    assert split_reasoning([4, 8, 9], [30, 9, 31], TH) == (None, [30, 9, 31], True)
    # A history with closed spans, and a template that lets the reply open its own.
    assert split_reasoning([8, 9, 30, 3, 5], [8, 20, 9, 30], TH) == ([20], [30], True)
    assert split_reasoning([8, 9, 30, 3, 5], [30, 31], TH) == (None, [30, 31], True)


def test_the_switch_is_the_templates_keyword_and_a_template_without_it_is_refused(tok, tmp_path):
    on = thinking_for(tok, RegenerateConfig(thinking=True))
    assert (on.kwargs, on.start_id, on.end_id) == ({"thinking": True}, 8, 9)
    assert thinking_for(tok, RegenerateConfig(thinking=False)).kwargs == {"thinking": False}
    assert thinking_for(tok, RegenerateConfig()) is None  # not a thinking model: nothing passed
    prompt = [{"role": "user", "content": "w20"}]
    assert (
        render_chat(tok, prompt, add_generation_prompt=True, **on.kwargs)[-1] == 8
    )  # ...<|im_middle|><think>
    assert render_chat(tok, prompt, add_generation_prompt=True, thinking=False)[-2:] == [
        8,
        9,
    ]  # ...<think></think>
    # Qwen3's name for the switch: Kimi's template has no such keyword, so both prompts are the
    # same.
    with pytest.raises(
        RegenerationError, match="no switch named 'enable_thinking'.*thinking_kwarg"
    ):
        thinking_for(tok, RegenerateConfig(thinking=True, thinking_kwarg="enable_thinking"))
    # Refused before any server is needed (the extract flow asks pending_parts first).
    with pytest.raises(RegenerationError, match="enable_thinking"):
        pending_parts(
            [],
            tok,
            tmp_path,
            RegenerateConfig(thinking=False, thinking_kwarg="enable_thinking"),
            target="t",
            max_length=64,
        )


def test_a_template_without_a_switch_or_a_tokenizer_without_think_tokens_is_refused(tmp_path):
    from transformers import AutoTokenizer

    plain = tmp_path / "plain"
    plain.mkdir()
    write_tokenizer(
        plain,
        template="{% for m in messages %}{{ m['content'] }}<|im_end|>{% endfor %}"
        "{% if add_generation_prompt %}<|im_assistant|>{% endif %}",
    )
    with pytest.raises(RegenerationError, match="has no switch named 'thinking'"):
        thinking_for(AutoTokenizer.from_pretrained(str(plain)), RegenerateConfig(thinking=True))
    # Kimi's template, but a vocabulary without <think> and </think> as tokens of their own.
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = Tokenizer(
        models.WordLevel({"[UNK]": 0, "<": 1, "think": 2, ">": 3, "/": 4}, unk_token="[UNK]")
    )
    words.pre_tokenizer = pre_tokenizers.Whitespace()
    spelled = PreTrainedTokenizerFast(tokenizer_object=words, unk_token="[UNK]")
    spelled.chat_template = kimi_template()
    with pytest.raises(RegenerationError, match="spells <think> as 3 tokens"):
        thinking_for(spelled, RegenerateConfig(thinking=False))


def test_kimis_template_drops_reasoning_where_the_release_does():
    from transformers.utils.chat_template_utils import render_jinja_template

    def render(chat, **kw):
        return render_jinja_template([chat], chat_template=kimi_template(), **kw)[0][0]

    user = {"role": "user", "content": "Hi"}
    answer = {"role": "assistant", "content": "Hello!", "reasoning_content": "greet back"}
    # The last assistant turn without tool calls, and every one before it: reasoning dropped.
    assert "<think></think>Hello!<|im_end|>" in render([user, answer])
    history = render(
        [user, answer, {"role": "user", "content": "More"}],
        add_generation_prompt=True,
        thinking=True,
    )
    assert "greet back" not in history and history.endswith(
        "<|im_assistant|>assistant<|im_middle|><think>"
    )
    # A tool-call chain still running: its reasoning stays, unless thinking is off.
    call = {
        "role": "assistant",
        "content": "",
        "reasoning_content": "need a tool",
        "tool_calls": [{"id": "functions.f:0", "function": {"name": "f", "arguments": "{}"}}],
    }
    result = {"role": "tool", "content": "42", "tool_call_id": "functions.f:0"}
    chain = [user, answer, {"role": "user", "content": "Use f"}, call, result]
    assert "<think>need a tool</think>" in render(chain, add_generation_prompt=True)
    off = render(chain, add_generation_prompt=True, thinking=False)
    assert "need a tool" not in off and off.endswith("<think></think>")
