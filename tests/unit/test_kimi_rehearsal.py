"""A rehearsal of the production config (configs/kimi-k2.5-sglang.yaml) on fixtures/kimi-k2.5,
Kimi-K2.5's checkpoint folder without weights: preflight passes, the SGLang launch captures the
right layers, the exported drafter's config.json has Kimi's sizes, and the refusals name their
fields.

The SSH host of the production config does not exist here, so the host checks are skipped
(check_hosts=False; tests/integration/test_preflight_hosts.py runs them against a real sshd), and so
is loading the tokenizer (check_tokenizer=False): the fixture has Kimi's tokenizer_config.json and
chat template but not its tiktoken vocabulary (fixtures/kimi-k2.5/README.md)."""

from __future__ import annotations

import json
import shlex
import shutil

import pytest

from eyas.config import load_config
from eyas.evaluation.export import check_layer_ids, sglang_config
from eyas.plan import DataCount, make_plan
from eyas.preflight import format_preflight, preflight
from eyas.server.launch import capture_launch, launch_command
from eyas.target import read_config
from eyas.training.train import drafter_config
from tests.stage_config import ROOT

KIMI = ROOT / "fixtures" / "kimi-k2.5"
CONVERSATIONS = ROOT / "fixtures" / "data" / "conversations.jsonl"


def kimi(tmp_path, **overrides):
    return load_config(
        ROOT / "configs" / "kimi-k2.5-sglang.yaml",
        {
            "target.checkpoint": str(KIMI),
            "target.local_dir": str(KIMI),
            "data.path": str(CONVERSATIONS),
            "run_dir": str(tmp_path / "run"),
            "extraction.output_dir": str(tmp_path / "shards"),
            "training.output_dir": str(tmp_path / "train"),
            **overrides,
        },
    )


def rehearse(cfg, **kw):
    # the disk check reads the production node's free bytes; this machine's are not under test
    kw.setdefault("free_bytes", 10**12)
    return preflight(cfg, check_hosts=False, check_tokenizer=False, **kw)


def fields(result) -> list[str]:
    return [p.split(":", 1)[0].split("=", 1)[0] for p in result.problems]


def test_the_fixture_is_kimi_k25_with_its_text_config_nested():
    raw = json.loads((KIMI / "config.json").read_text())
    assert raw["architectures"] == ["KimiK25ForConditionalGeneration"] and "hidden_size" not in raw
    text = read_config(KIMI)  # eyas's one reader flattens text_config
    assert (text["num_hidden_layers"], text["hidden_size"], text["vocab_size"]) == (
        61,
        7168,
        163840,
    )
    assert (text["n_routed_experts"], text["num_experts_per_tok"], text["kv_lora_rank"]) == (
        384,
        8,
        512,
    )
    for q in (raw["quantization_config"], text["quantization_config"]):
        assert (
            q["config_groups"]["group_0"]["weights"]["num_bits"] == 4
            and q["quant_method"] == "compressed-tensors"
        )
    shards = set(
        json.loads((KIMI / "model.safetensors.index.json").read_text())["weight_map"].values()
    )
    assert len(shards) == 64 and "model-00064-of-000064.safetensors" in shards


def test_training_finds_kimis_head_in_its_shard_through_the_index():
    from eyas.training.target_head import load_target_tensors

    # The names sit under language_model.; the index sends lm_head to shard 62, which has no weights
    # here.
    with pytest.raises(FileNotFoundError, match="model-00062-of-000064.safetensors"):
        load_target_tensors(KIMI, ["lm_head", "norm"])


def test_the_chat_template_renders_kimis_format():
    from transformers.utils.chat_template_utils import render_jinja_template

    template = json.loads((KIMI / "tokenizer_config.json").read_text())["chat_template"]
    chat = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}]
    full = render_jinja_template([chat], chat_template=template)[0][0]
    assert full == (
        "<|im_system|>system<|im_middle|>You are Kimi, an AI assistant created by "
        "Moonshot AI.<|im_end|><|im_user|>user<|im_middle|>Hi<|im_end|>"
        "<|im_assistant|>assistant<|im_middle|><think></think>Hello!<|im_end|>"
    )
    prompt = render_jinja_template([chat[:1]], chat_template=template, add_generation_prompt=True)[
        0
    ][0]
    assert prompt.endswith("<|im_assistant|>assistant<|im_middle|><think>")
    assert full.startswith(
        prompt
    )  # eyas's loss mask: the answer starts where the generation prompt ends


def test_preflight_of_the_production_config_passes(tmp_path):
    r = rehearse(kimi(tmp_path))
    assert r.ok, r.problems
    p = r.plan
    assert (
        p.bytes_per_token == 4 * 7168 * 2 + 5
    )  # 57,344 B of hidden states per token, plus id and mask
    assert p.num_shards == 500 and p.data.sequences == 500 - 64  # data.num_heldout 64
    assert 1.19e9 < p.trainable_params < 1.192e9  # docs: 1.19B trainable parameters
    assert [s.name for s in p.stages] == [
        "extract",
        "regenerate",
        "train",
    ]  # a thinking target answers again
    assert any("check_hosts=False" in n for n in r.notes) and any(
        "check_tokenizer=False" in n for n in r.notes
    )


def test_preflight_plans_the_seeds_node_8x96_gb_at_16k_tokens(tmp_path):
    cfg = kimi(tmp_path)
    r = rehearse(cfg)
    p = r.plan
    # One RTX PRO 6000 (96 GB) per process, 8 of them; 16k tokens at one sequence per micro-batch.
    assert (p.gpu_memory_gb, cfg.data.max_length, cfg.training.batch_size) == (96, 16384, 1)
    assert cfg.training.batch_size * cfg.training.grad_accum * 8 == 32
    assert (
        58 < p.train_memory_gb < 65
    )  # measured 61.4 GB at 4 x 4096, the same tokens (docs/performance.md)
    by_length = dict(p.memory_by_length)  # GB at batch 1, 2, 4
    assert (
        by_length[16384][0] == by_length[8192][1] == pytest.approx(p.train_memory_gb, abs=0.05)
    )  # same tokens
    assert by_length[16384][1] > 96 * 0.94  # two 16k sequences do not fit a 96 GB card
    text = format_preflight(r, cfg)
    assert "plan.gpu_memory_gb=96 at training.batch_size=1 x data.max_length=16384" in text
    assert "8,192: 44.5/61.4/95.4!; 16,384: 61.4/95.4!/163.2!" in text and text.endswith(
        "preflight: OK"
    )


def test_the_fixture_tokenizer_does_not_load_and_preflight_says_so(tmp_path):
    r = preflight(
        kimi(tmp_path), check_hosts=False, free_bytes=10**12
    )  # trusted (backend sglang), but no tokenization_kimi.py
    assert fields(r) == ["target.local_dir"] and "load_tokenizer" in r.problems[0]
    assert "tokenization_kimi" in r.problems[0]
    r = preflight(
        kimi(tmp_path, **{"target.trust_remote_code": False}), check_hosts=False, free_bytes=10**12
    )
    assert fields(r) == ["target.trust_remote_code"] and "TikTokenTokenizer" in r.problems[0]


def test_a_full_sized_extraction_is_planned_in_bytes_and_hours(tmp_path):
    cfg = kimi(tmp_path)
    count = DataCount(
        sequences=600_000, tokens=17_300_000, assistant_turns=0, conversations=True, source="given"
    )
    plan = make_plan(cfg, read_config(KIMI), count)
    assert plan.total_bytes == pytest.approx(
        17.3e6 * 57_344, rel=0.001
    )  # eagle3.md: 992 GB in bf16
    assert plan.stages[0].hours == pytest.approx(17.3e6 / cfg.plan.prefill_tokens_per_s / 3600)
    fp8 = make_plan(kimi(tmp_path, **{"extraction.encoding": "fp8_e4m3"}), read_config(KIMI), count)
    assert fp8.total_bytes / plan.total_bytes == pytest.approx(0.5, abs=0.01)
    r = rehearse(
        cfg, free_bytes=900 * 10**9
    )  # its own data fits; ask for the 17.3M-token run's room
    assert r.ok and r.plan.free_bytes < plan.total_bytes


def test_the_capture_launch_asks_sglang_for_layers_2_30_58(tmp_path):
    args = shlex.split(launch_command(capture_launch(kimi(tmp_path))))
    assert args[:3] == ["/opt/sglang/.venv/bin/python3", "-m", "sglang.launch_server"]
    assert args[args.index("--model-path") + 1] == str(KIMI)
    assert "--enable-return-aux-hidden-states" in args
    at = args.index("--return-aux-hidden-state-layer-ids")
    assert args[at + 1 : at + 4] == ["2", "30", "58"] and args[at + 4].startswith("--")
    assert (
        args[args.index("--speculative-algorithm") + 1] == "EAGLE3"
    )  # names the convention; no draft
    hook = json.loads(args[args.index("--forward-hooks") + 1])[0]
    assert hook["config"]["layer_ids"] == [2, 30, 58] and hook["target_modules"] == [
        "*logits_processor"
    ]
    out_of = shlex.split(
        launch_command(
            capture_launch(
                kimi(
                    tmp_path,
                    **{"target.layer_ids": [1, 29, 57], "target.layer_convention": "output-of"},
                )
            )
        )
    )
    at = out_of.index("--return-aux-hidden-state-layer-ids")
    assert out_of[at + 1 : at + 4] == [
        "2",
        "30",
        "58",
    ]  # output-of 1, 29, 57 = the inputs of 2, 30, 58


def test_the_exported_drafter_config_has_kimis_sizes(tmp_path):
    cfg = kimi(tmp_path)
    tcfg = read_config(KIMI)
    dcfg = drafter_config(cfg.training, tcfg, tcfg["hidden_size"], len(cfg.target.layer_ids))
    shards = {"layer_ids": [2, 30, 58], "layer_convention": "capture-before"}
    capture = check_layer_ids(cfg.target, shards, None, tcfg["num_hidden_layers"])
    meta = sglang_config(dcfg, capture, cfg.export.dtype, provenance={})
    assert meta["architectures"] == ["LlamaForCausalLMEagle3"]
    assert (meta["hidden_size"], meta["target_hidden_size"]) == (7168, 7168)
    assert (meta["vocab_size"], meta["draft_vocab_size"]) == (163840, 32000)
    assert meta["eagle_config"] == {
        "eagle_aux_hidden_state_layer_ids": [2, 30, 58],
        "use_aux_hidden_state": True,
    }
    assert (meta["num_attention_heads"], meta["head_dim"], meta["intermediate_size"]) == (
        64,
        128,
        18432,
    )
    # The rope the drafter trains with (eyas/training/drafter.py: plain RoPE at the target's base),
    # not the target's YaRN: SGLang applies what config.json says (docs/production.md, "Long
    # context").
    assert meta["rope_theta"] == dcfg.rope_theta == tcfg["rope_theta"] == 50000.0
    assert meta["rope_scaling"] is None and tcfg["rope_scaling"]["type"] == "yarn"
    assert meta["max_position_embeddings"] == 262144


def test_layer_70_is_refused_naming_target_layer_ids(tmp_path):
    r = rehearse(kimi(tmp_path, **{"target.layer_ids": [2, 30, 70]}))
    assert fields(r) == ["target.layer_ids"] and "for the target's 61 layers" in r.problems[0]
    r = rehearse(
        kimi(tmp_path, **{"target.layer_ids": [2, 30, 60], "target.layer_convention": "output-of"})
    )
    assert fields(r) == ["target.layer_ids"] and "[61] out of range" in r.problems[0]


def test_an_unknown_architecture_is_refused_naming_it(tmp_path):
    other = tmp_path / "target"
    shutil.copytree(KIMI, other)
    raw = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(
        json.dumps({**raw, "architectures": ["KimiVLForConditionalGeneration"]})
    )
    r = rehearse(kimi(tmp_path, **{"target.local_dir": str(other)}))
    assert (
        fields(r) == ["target.local_dir"]
        and "architecture KimiVLForConditionalGeneration" in r.problems[0]
    )
    assert "set_eagle3_layers_to_capture" in r.problems[0]  # the manifest's reason for refusing it
    local = rehearse(
        kimi(tmp_path, **{"server.backend": "local"})
    )  # eyas's local server: DeepSeek-V3 only
    assert fields(local) == ["target.local_dir"] and "server.backend=local" in local.problems[0]


def test_too_little_disk_is_refused_naming_extraction_output_dir(tmp_path):
    r = rehearse(
        kimi(tmp_path), free_bytes=10 * 10**9
    )  # extraction.keep_free_gb is 50 in this config
    assert fields(r) == ["extraction.output_dir"] and "extraction.keep_free_gb=50" in r.problems[0]


def test_a_batch_over_the_96_gb_card_is_refused_naming_training_batch_size(tmp_path):
    # ~95.4 GB estimated is under 96 but not under 96 less the estimate's 6% error: it would not fit
    r = rehearse(kimi(tmp_path, **{"training.batch_size": 2}))
    assert fields(r) == ["training.batch_size"] and "plan.gpu_memory_gb=96" in r.problems[0]
    assert "about 1 sequence(s) per micro-batch fit" in r.problems[0]
    r = rehearse(kimi(tmp_path, **{"training.batch_size": 16, "data.max_length": 4096}))
    assert "about 7 sequence(s) per micro-batch fit" in r.problems[0]


def test_the_h200_variant_plans_two_16k_sequences_per_141_gb(tmp_path):
    cfg = load_config(
        ROOT / "configs" / "kimi-k2.5-sglang-h200.yaml",
        {
            "target.checkpoint": str(KIMI),
            "target.local_dir": str(KIMI),
            "data.path": str(CONVERSATIONS),
            "run_dir": str(tmp_path / "run"),
            "extraction.output_dir": str(tmp_path / "shards"),
            "training.output_dir": str(tmp_path / "train"),
        },
    )
    r = rehearse(cfg)
    assert r.ok, r.problems
    assert (r.plan.gpu_memory_gb, cfg.data.max_length, cfg.training.batch_size) == (141, 16384, 2)
    assert 90 < r.plan.train_memory_gb < 100
    assert "NCCL_PROTO" not in {
        **cfg.server.env,
        **cfg.benchmark.server_env,
    }  # NVLink: NCCL chooses


def test_capture_and_serving_launches_get_the_seeds_node_flags_where_they_belong(tmp_path):
    from eyas.dump import DUMP_DIR_ENV
    from eyas.evaluation.serving import Chain, serving_launch
    from eyas.server.launch import launch_env

    cfg = kimi(tmp_path)
    capture = shlex.split(launch_command(capture_launch(cfg)))
    plain = serving_launch(cfg, "plain", None)
    spec = serving_launch(cfg, "spec", tmp_path / "drafter", chain=Chain.of(3))
    serving = [shlex.split(launch_command(c)) for c in (plain, spec)]
    for args in (capture, *serving):  # every launch on the PCIe node
        assert args[args.index("--tp-size") + 1] == "8" and "--disable-custom-all-reduce" in args
        assert "--trust-remote-code" in args
    # the prefill-only capture server: no graphs (its hook runs in eager forwards), no serving
    # tuning
    assert "--disable-cuda-graph" in capture and "--disable-prefill-cuda-graph" in capture
    assert "--num-continuous-decode-steps" not in capture
    for args in serving:  # as the team serves: graphs on, continuous decode steps 4
        assert "--disable-cuda-graph" not in args and "--disable-prefill-cuda-graph" not in args
        assert args[args.index("--num-continuous-decode-steps") + 1] == "4"
    assert (
        "--speculative-draft-model-path" in serving[1]
        and "--speculative-draft-model-path" not in serving[0]
    )
    # NCCL: Ring everywhere and LL on the capture, as the team's working capture launch ran
    env = launch_env(capture_launch(cfg))
    assert env["NCCL_ALGO"] == "Ring" and env["NCCL_PROTO"] == "LL" and DUMP_DIR_ENV in env
    for c in (plain, spec):
        env = launch_env(c)
        assert (env["NCCL_ALGO"], env["NCCL_PROTO"]) == ("Ring", "LL") and DUMP_DIR_ENV not in env
