"""A thinking target's regeneration, without a server: the template's switch, the reasoning span, the
Kimi fixture's history rules, the local server's reasoning span, the report's figures."""

import json

import pytest
import torch

from eyas.config import RegenerateConfig
from eyas.extraction.regenerate import (RegenerationError, Thinking, _params, _render_kw, pending_parts,
                                        split_reasoning, thinking_for)
from eyas.local.batch import Sequence, Think
from eyas.report import regeneration_section
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
    # The prompt ends in <think></think> (thinking off): an answer, even if it spells </think> later.
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
    assert _render_kw(tok, prompt, True, on.kwargs)[-1] == 8  # ...<|im_middle|><think>
    assert _render_kw(tok, prompt, True, {"thinking": False})[-2:] == [8, 9]  # ...<think></think>
    # Qwen3's name for the switch: Kimi's template has no such keyword, so both prompts are the same.
    with pytest.raises(RegenerationError, match="no switch named 'enable_thinking'.*thinking_kwarg"):
        thinking_for(tok, RegenerateConfig(thinking=True, thinking_kwarg="enable_thinking"))
    # Refused before any server is needed (the extract flow asks pending_parts first).
    with pytest.raises(RegenerationError, match="enable_thinking"):
        pending_parts([], tok, tmp_path, RegenerateConfig(thinking=False, thinking_kwarg="enable_thinking"),
                      target="t", max_length=64)


def test_a_template_without_a_switch_or_a_tokenizer_without_think_tokens_is_refused(tmp_path):
    from transformers import AutoTokenizer

    plain = tmp_path / "plain"
    plain.mkdir()
    write_tokenizer(plain, template="{% for m in messages %}{{ m['content'] }}<|im_end|>{% endfor %}"
                                   "{% if add_generation_prompt %}<|im_assistant|>{% endif %}")
    with pytest.raises(RegenerationError, match="has no switch named 'thinking'"):
        thinking_for(AutoTokenizer.from_pretrained(str(plain)), RegenerateConfig(thinking=True))
    # Kimi's template, but a vocabulary without <think> and </think> as tokens of their own.
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = Tokenizer(models.WordLevel({"[UNK]": 0, "<": 1, "think": 2, ">": 3, "/": 4}, unk_token="[UNK]"))
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
    history = render([user, answer, {"role": "user", "content": "More"}], add_generation_prompt=True, thinking=True)
    assert "greet back" not in history and history.endswith("<|im_assistant|>assistant<|im_middle|><think>")
    # A tool-call chain still running: its reasoning stays, unless thinking is off.
    call = {"role": "assistant", "content": "", "reasoning_content": "need a tool",
            "tool_calls": [{"id": "functions.f:0", "function": {"name": "f", "arguments": "{}"}}]}
    result = {"role": "tool", "content": "42", "tool_call_id": "functions.f:0"}
    chain = [user, answer, {"role": "user", "content": "Use f"}, call, result]
    assert "<think>need a tool</think>" in render(chain, add_generation_prompt=True)
    off = render(chain, add_generation_prompt=True, thinking=False)
    assert "need a tool" not in off and off.endswith("<think></think>")


def test_params_of_a_target_without_thinking_are_unchanged_so_its_finished_parts_stay_reusable():
    legacy = {"max_new_tokens": 512, "temperature": 0.0, "seed": 0, "stop_token_ids": [3], "max_length": 64,
              "target": "t"}
    assert _params(RegenerateConfig(), [3], 64, "t") == legacy
    assert _params(RegenerateConfig(thinking=False), [3], 64, "t") == {**legacy, "thinking": {"thinking": False}}


def _take(seq: Sequence, logits: torch.Tensor, n: int) -> list[int]:
    for _ in range(n):
        if seq.take(logits):
            break
    return seq.output


def test_the_local_servers_reasoning_span_closes_after_its_budget():
    logits = torch.zeros(16)
    logits[3] = 5.0   # the stop token: the model's favourite
    logits[12] = 4.0  # then a word
    gen = torch.Generator().manual_seed(0)

    def seq(think):
        return Sequence(logits, None, 4, 8, 0.0, {3}, gen, think=think)

    # Inside the <think> the template opened: 3 reasoning tokens (the stop token is never sampled
    # there), </think>, then the answer, which stops at the stop token.
    think = Think.plan([1, 2, 8], 8, 9, 3)
    assert _take(seq(think), logits, 8) == [12, 12, 12, 9, 3] and think.count == 3
    # A prompt that closed it (thinking off): no span at all.
    assert Think.plan([1, 8, 9], 8, 9, 3) is None
    # A prompt with no open span: the reply opens its own.
    think = Think.plan([1, 8, 9, 12, 3, 2], 8, 9, 2)
    assert _take(seq(think), logits, 8) == [8, 12, 12, 9, 3] and think.count == 2
    # Cut by max_new_tokens inside the span.
    cut = Sequence(logits, None, 4, 2, 0.0, {3}, gen, think=Think.plan([8], 8, 9, 5))
    assert _take(cut, logits, 8) == [12, 12] and cut.finish == {"type": "length", "length": 2}
    # Without --think-tokens the choice is the plain argmax.
    assert _take(seq(None), logits, 8) == [3]


def test_the_report_counts_the_reasoning_tokens_of_the_regenerated_replies():
    assert regeneration_section({"sequences": 3}) is None  # not regenerated
    stats = {"regeneration": {"format": "eyas-regen/1", "thinking": True, "regenerated_turns": 6,
                              "output_tokens": 60, "reasoning_tokens": 24, "server_reasoning_tokens": 24,
                              "sequences": 7, "parts": 2}}
    section = regeneration_section(stats)
    assert section["reasoning_tokens"] == 24 and section["output_tokens"] == 60 and section["thinking"] is True
    assert "format" not in section and json.dumps(section)


def test_held_out_and_suite_prompts_are_rendered_with_the_switch_as_the_target_is_served(tok, tmp_path):
    """Evaluation asks the target as it is served: the held-out prompts end in an open <think> with
    thinking on, in an empty <think></think> with it off, and as before for a target that does not think."""
    from eyas.config import DataConfig
    from eyas.evaluation.suites import tokenize
    from eyas.extraction.data import prepare, prompt_kwargs

    conversations = [{"messages": [{"role": "user", "content": f"w{20 + i}"},
                                   {"role": "assistant", "content": f"w{40 + i} w41"}]} for i in range(4)]
    def heldout(thinking):
        cfg = DataConfig(path=tmp_path / "d.jsonl", max_length=64, num_heldout=2,
                         regenerate=RegenerateConfig(thinking=thinking))
        return prepare([c["messages"] for c in conversations], tok, cfg, vocab_size=512).heldout_prompts, cfg
    on, cfg_on = heldout(True)
    off, cfg_off = heldout(False)
    plain, cfg_plain = heldout(None)
    assert [p[-1] for p in on] == [8, 8] and [p[-2:] for p in off] == [[8, 9], [8, 9]]
    assert plain == on  # no keyword passed: the template's default, thinking
    assert prompt_kwargs(cfg_plain) == {} and prompt_kwargs(cfg_on) == {"thinking": True}
    assert tokenize(["w20"], tok, 64, **prompt_kwargs(cfg_off))[0][-2:] == [8, 9]
