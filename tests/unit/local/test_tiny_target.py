"""Tests for eyas.local.tiny_target: the architecture, training, the Hugging Face folder it saves
with the chat template, and the committed fixtures (fixtures/tiny-target,
fixtures/data/conversations.jsonl). The corpus and tokenizer: test_tiny_corpus.py; the sharded
folder's plan: test_hf_folder.py."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, DeepseekV3ForCausalLM

from eyas.config import load_config
from eyas.local import tiny_corpus as tc
from eyas.local import tiny_target as tt

REPO = Path(__file__).resolve().parents[3]
FIXTURE = REPO / "fixtures" / "tiny-target"
CONVERSATIONS = REPO / "fixtures" / "data" / "conversations.jsonl"
CAPTURE_IDS = load_config(
    REPO / "configs" / "local-tiny.yaml"
).target.capture_ids()  # capture-before ids

#: Code in the standard library's style that is in no file of it, so the fixture never saw it.
HELD_OUT_CODE = '''import os
import sys


def read_lines(path, encoding="utf-8"):
    """Return the lines of the file at *path*, without their newlines."""
    with open(path, encoding=encoding) as f:
        return [line.rstrip("\\n") for line in f]


class Counter:
    """Count how often each key is seen."""

    def __init__(self):
        self._counts = {}

    def add(self, key):
        self._counts[key] = self._counts.get(key, 0) + 1

    def get(self, key, default=0):
        return self._counts.get(key, default)

    def __len__(self):
        return len(self._counts)

    def __repr__(self):
        return f"{self.__class__.__name__}({self._counts!r})"


def main(argv=None):
    if argv is None:
        argv = sys.argv[1:]
    counter = Counter()
    for name in argv:
        if not os.path.isfile(name):
            print(f"{name}: not a file", file=sys.stderr)
            continue
        for line in read_lines(name):
            counter.add(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
'''

CONVERSATION = [
    {"role": "user", "content": "Continue this code:\ndef add(a, b):\n"},
    {"role": "assistant", "content": "    return a + b\n"},
    {"role": "user", "content": "Continue."},
    {"role": "assistant", "content": "\n\ndef sub(a, b):\n    return a - b\n"},
]


@pytest.fixture(scope="module")
def saved(small_tokenizer, tmp_path_factory):
    """A random-init tiny model saved with save_hf_folder, and the model it came from."""
    torch.manual_seed(0)
    model = DeepseekV3ForCausalLM(tt.tiny_config(small_tokenizer.get_vocab_size())).eval()
    out = tmp_path_factory.mktemp("hf") / "tiny"
    tt.save_hf_folder(model, small_tokenizer, out)
    return model, out


# --- architecture ---------------------------------------------------------------------------------


def test_tiny_config_is_a_small_deepseek_v3_with_mla_and_moe():
    config = tt.tiny_config(4096)
    assert config.model_type == "deepseek_v3" and config.num_hidden_layers == 8
    assert config.q_lora_rank and config.kv_lora_rank and config.qk_rope_head_dim  # MLA
    assert (config.n_routed_experts, config.num_experts_per_tok, config.n_shared_experts) == (
        8,
        2,
        1,
    )
    assert (config.first_k_dense_replace, config.n_group, config.topk_group) == (1, 1, 1)
    assert config.max_position_embeddings >= 1024
    num_params = sum(p.numel() for p in DeepseekV3ForCausalLM(config).parameters())
    assert 5e6 <= num_params <= 10e6


def test_tiny_config_rejects_a_vocab_smaller_than_bytes_and_specials():
    with pytest.raises(ValueError, match="vocab_size"):
        tt.tiny_config(100)


def test_hidden_states_are_the_inputs_of_the_decoder_layers():
    torch.manual_seed(0)
    model = DeepseekV3ForCausalLM(tt.tiny_config(512)).eval()
    inputs = {}
    for i, layer in enumerate(model.model.layers):
        layer.register_forward_pre_hook(lambda _m, args, i=i: inputs.__setitem__(i, args[0]))
    x = torch.randint(0, 512, (2, 33))
    with torch.no_grad():
        out = model(input_ids=x, output_hidden_states=True)
    assert len(out.hidden_states) == model.config.num_hidden_layers + 1
    for i in CAPTURE_IDS:  # capture id i = HF hidden_states[i] = input of decoder layer i
        torch.testing.assert_close(out.hidden_states[i], inputs[i])
    # The last state is after the final norm: the logits come straight from it.
    torch.testing.assert_close(model.lm_head(out.hidden_states[-1]), out.logits)


# --- the chat template ----------------------------------------------------------------------------


def test_chat_template_renders_a_prefix_of_the_messages_as_a_token_prefix(saved):
    tokenizer = AutoTokenizer.from_pretrained(saved[1])
    full = tc.chat_token_ids(tokenizer, CONVERSATION)
    assert full[0] == tc.BOS_ID and full[-1] == tc.END_ID
    for k in range(1, len(CONVERSATION) + 1):
        prefix = tc.chat_token_ids(tokenizer, CONVERSATION[:k])
        assert full[: len(prefix)] == prefix
        if k < len(CONVERSATION) and CONVERSATION[k]["role"] == "assistant":
            prompt = tc.chat_token_ids(tokenizer, CONVERSATION[:k], add_generation_prompt=True)
            answer = full[len(prompt) : len(tc.chat_token_ids(tokenizer, CONVERSATION[: k + 1]))]
            # The assistant's tokens are its content, then <|end|>: one contiguous span for a loss
            # mask.
            assert full[: len(prompt)] == prompt and answer[-1] == tc.END_ID
            assert tokenizer.decode(answer[:-1]) == CONVERSATION[k]["content"]


# --- training and evaluation ----------------------------------------------------------------------


def test_evaluate_predicts_every_token_but_the_first_once():
    model = DeepseekV3ForCausalLM(tt.tiny_config(512))
    ids = np.random.default_rng(0).integers(0, 512, 150).astype(np.uint16)
    result = tt.evaluate(model, ids, seq_len=32, device="cpu", batch_size=3)
    assert result["num_tokens"] == ids.size - 1
    assert result["loss"] == pytest.approx(
        np.log(512), rel=0.05
    )  # an untrained model is near uniform


def test_train_model_learns_a_repeating_stream_and_balances_experts():
    ids = np.tile(np.arange(7, 40, dtype=np.uint16), 200)
    settings = tt.TrainSettings(
        steps=30, batch_size=4, seq_len=32, lr=3e-3, warmup_steps=3, eval_every=10
    )
    model, run = tt.train_model(
        tt.tiny_config(512), ids, ids[:300], settings, device="cpu", log=lambda _: None
    )
    assert run["best"]["val_accuracy"] > 0.5 and run["steps_done"] == 30
    biases = torch.stack([m.e_score_correction_bias for m in tt._routers(model)])
    assert biases.abs().sum() > 0  # the aux-loss-free balancing moved the router biases


def test_train_settings_reject_nonsense():
    with pytest.raises(ValueError, match="steps"):
        tt.TrainSettings(steps=0)
    with pytest.raises(ValueError, match="schedule"):
        tt.TrainSettings(steps=10, lr=-1.0)


# --- the Hugging Face folder ----------------------------------------------------------------------


def test_save_hf_folder_writes_a_sharded_checkpoint_transformers_loads(saved):
    model, out = saved
    shards = sorted(out.glob("model-*.safetensors"))
    assert len(shards) >= 8 and all(
        re.fullmatch(r"model-\d{5}-of-\d{5}\.safetensors", s.name) for s in shards
    )
    index = json.loads((out / "model.safetensors.index.json").read_text())
    from safetensors import safe_open

    names_in_files = {}
    for shard in shards:
        with safe_open(shard, "pt") as f:
            names_in_files.update({name: shard.name for name in f.keys()})
    assert index["weight_map"] == names_in_files
    assert (
        "model.layers.1.mlp.experts.7.up_proj.weight" in names_in_files
    )  # DeepSeek-V3's own layout
    config = json.loads((out / "config.json").read_text())
    assert (
        config["architectures"] == ["DeepseekV3ForCausalLM"]
        and config["model_type"] == "deepseek_v3"
    )

    loaded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    reference = DeepseekV3ForCausalLM(
        model.config
    ).eval()  # the saved model, rounded to bf16 as stored
    reference.load_state_dict(
        {k: v.to(torch.bfloat16).float() for k, v in model.state_dict().items()}
    )
    x = torch.randint(0, model.config.vocab_size, (1, 40))
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids=x).logits, reference(input_ids=x).logits)


def test_save_hf_folder_writes_a_tokenizer_with_the_chat_template(saved):
    tokenizer = AutoTokenizer.from_pretrained(saved[1])
    assert tokenizer.chat_template == tc.CHAT_TEMPLATE
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id) == (
        tc.BOS_ID,
        tc.EOS_ID,
        tc.PAD_ID,
    )
    assert (
        json.loads((saved[1] / "tokenizer_config.json").read_text())["chat_template"]
        == tc.CHAT_TEMPLATE
    )


def test_save_hf_folder_replaces_the_old_folder_and_leaves_no_temporaries(
    saved, small_tokenizer, tmp_path
):
    model, _ = saved
    out = tmp_path / "tiny"
    tt.save_hf_folder(model, small_tokenizer, out, num_shards=9)
    tt.save_hf_folder(model, small_tokenizer, out, num_shards=8)
    assert len(list(out.glob("model-*.safetensors"))) == 8
    with pytest.raises(ValueError, match="num_shards"):
        tt.save_hf_folder(model, small_tokenizer, out, num_shards=10_000)
    assert (
        len(list(out.glob("model-*.safetensors"))) == 8
    )  # the failed save left the old folder alone
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tiny"]


# --- the committed fixtures -----------------------------------------------------------------------


def test_committed_fixture_is_small_and_sharded():
    assert sum(f.stat().st_size for f in FIXTURE.iterdir()) < 25e6
    assert len(list(FIXTURE.glob("model-*-of-*.safetensors"))) >= 8
    build = json.loads((FIXTURE / "eyas_build.json").read_text())
    # Measured on held-out standard-library files at build time (docs/tiny-target.md).
    assert (
        build["fixture_test_accuracy"]
        > build["bigram_accuracy"] + 0.15
        > 10 * build["unigram_accuracy"]
    )


def test_committed_fixture_predicts_held_out_code_well_above_chance():
    model = AutoModelForCausalLM.from_pretrained(FIXTURE, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(FIXTURE)
    ids = torch.tensor([[tc.BOS_ID] + tokenizer(HELD_OUT_CODE)["input_ids"]])
    with torch.no_grad():
        predicted = model(input_ids=ids[:, :-1]).logits.argmax(-1)
    accuracy = (predicted == ids[:, 1:]).float().mean().item()
    most_common = (
        torch.bincount(ids[0]).max().item() / ids.numel()
    )  # best constant guess, on the answers
    assert accuracy > 0.45 and accuracy > 4 * most_common, (accuracy, most_common)


def test_committed_conversations_fit_the_pipeline():
    assert CONVERSATIONS.stat().st_size < 1.5e6
    rows = [json.loads(line) for line in CONVERSATIONS.read_text().splitlines()]
    assert 400 <= len(rows) <= 600
    tokenizer = AutoTokenizer.from_pretrained(FIXTURE)
    lengths, num_multi_turn = [], 0
    for row in rows:
        roles = [m["role"] for m in row["messages"]]
        assert roles in (["user", "assistant"], ["user", "assistant"] * 2)
        num_multi_turn += len(roles) == 4
        lengths.append(len(tc.chat_token_ids(tokenizer, row["messages"])))
    assert 120 <= min(lengths) and max(lengths) <= 400
    assert num_multi_turn >= 50
    assert len({json.dumps(r) for r in rows}) == len(rows)  # no duplicates


# --- bf16 serving, on CPU and (where there is one) on a CUDA GPU ----------------------------------


NEEDS_CUDA = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=NEEDS_CUDA)])
def test_committed_fixture_in_bf16_matches_fp32(device):
    """The MoE and MLA paths run in bf16 and stay close to fp32: capture layers within a few
    percent, greedy predictions nearly all the same (a near-tie in routing may flip an expert)."""
    model = AutoModelForCausalLM.from_pretrained(FIXTURE, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(FIXTURE)
    x = torch.tensor([[tc.BOS_ID] + tokenizer(HELD_OUT_CODE)["input_ids"]])
    with torch.no_grad():
        reference = model(input_ids=x, output_hidden_states=True)
        bf16 = model.to(device, torch.bfloat16)(input_ids=x.to(device), output_hidden_states=True)
    assert len(bf16.hidden_states) == model.config.num_hidden_layers + 1
    for i in CAPTURE_IDS:
        got, want = bf16.hidden_states[i].float().cpu(), reference.hidden_states[i]
        assert (got - want).norm() / want.norm() < 0.05
    agree = (bf16.logits.argmax(-1).cpu() == reference.logits.argmax(-1)).float().mean().item()
    assert agree > 0.9
