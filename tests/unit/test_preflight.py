"""eyas preflight on the embedded default: every refusal names its field, all problems are collected,
the token count agrees with prepare's, and the SSH checks run against a real sshd (no mocks)."""

from __future__ import annotations

import json
import shutil

import pytest

from eyas.cli import main as cli
from eyas.config import load_config
from eyas.extraction import data
from eyas.plan import count_tokens, trainable_params, training_memory
from eyas.preflight import has_chat_template, layer_id_problems, preflight
from eyas.target import load_tokenizer
from tests.stage_config import ROOT

TINY = ROOT / "fixtures" / "tiny-target"
CONVERSATIONS = ROOT / "fixtures" / "data" / "conversations.jsonl"


def tiny(tmp_path, **overrides):
    return load_config(ROOT / "configs" / "local-tiny.yaml", {
        "run_dir": str(tmp_path / "run"), "extraction.output_dir": str(tmp_path / "shards"),
        "training.output_dir": str(tmp_path / "train"), **overrides})


def fields(result) -> list[str]:
    return [p.split(":", 1)[0].split("=", 1)[0] for p in result.problems]


def test_the_embedded_default_passes_and_plans(tmp_path):
    r = preflight(tiny(tmp_path))
    assert r.ok, r.problems
    p = r.plan
    assert p.data.sequences == 468 and p.data.conversations and "tokenized" in p.data.source
    assert p.bytes_per_token == 4 * 256 * 2 + 5  # 3 aux layers + the last, hidden 256, bf16, id + mask
    assert p.total_bytes > p.data.tokens * p.bytes_per_token
    assert [s.name for s in p.stages] == ["extract", "regenerate", "train"]
    assert p.stages[0].hours == pytest.approx(p.data.tokens / 4000 / 3600)
    assert 1.4e6 < p.trainable_params < 1.7e6  # docs: 1.57M trainable parameters
    assert any("server.host.kind=local" in n for n in r.notes)


def test_layer_id_50_passes_check_config_but_not_preflight(tmp_path):
    cfg = tiny(tmp_path, **{"target.layer_ids": [2, 4, 50]})  # load_config (check-config) accepts it
    r = preflight(cfg)
    assert fields(r) == ["target.layer_ids"]
    assert "[50] out of range for the target's 8 layers" in r.problems[0] and "1 to 7" in r.problems[0]


@pytest.mark.parametrize("ids, convention, expect", [
    ([2, 4, 5], "capture-before", None),
    ([1, 3, 4], "output-of", None),  # capture [2, 4, 5]
    ([1, 4, 5], "capture-before", "shifted to [2, 5, 6]"),
    ([2, 4, 7], "output-of", "[8] out of range"),  # 7's output is the final norm's input
    ([0, 4, 5], "capture-before", "[0] out of range"),
    ([2, 4], "capture-before", "exactly 3 layers"),
])
def test_layer_ids_in_the_capture_convention(ids, convention, expect):
    from eyas.config import TargetConfig

    found = layer_id_problems(TargetConfig(checkpoint=TINY, layer_ids=ids, layer_convention=convention), 8)
    assert (found == []) if expect is None else (len(found) == 1 and expect in found[0]), found


def test_all_problems_are_collected_each_naming_its_field(tmp_path):
    cfg = tiny(tmp_path, **{"target.layer_ids": [2, 4, 9], "training.draft_vocab_size": 5000,
                            "data.max_length": 5000, "training.batch_size": 500})
    r = preflight(cfg, free_bytes=10)
    assert fields(r) == ["target.layer_ids", "data.max_length", "training.draft_vocab_size",
                         "extraction.output_dir", "training.batch_size"]
    assert "5000" in r.problems[2] and "4096" in r.problems[2]
    assert "0.00 GB free" in r.problems[3] and "extraction.keep_free_gb=1.0" in r.problems[3]


def test_too_little_disk_is_refused_naming_the_output_dir(tmp_path):
    r = preflight(tiny(tmp_path), free_bytes=100_000_000)  # 0.1 GB: less than the shards + 1 GB kept free
    assert fields(r) == ["extraction.output_dir"] and str(tmp_path / "shards") in r.problems[0]
    r = preflight(tiny(tmp_path, **{"extraction.keep_free_gb": 0}), free_bytes=int(r.plan.total_bytes) + 1)
    assert r.ok, r.problems


def test_fp8_halves_the_bytes(tmp_path):
    plain = preflight(tiny(tmp_path)).plan
    fp8 = preflight(tiny(tmp_path, **{"extraction.encoding": "fp8_e4m3"})).plan
    assert fp8.bytes_per_token == 4 * (256 + 4) + 5 and 0.5 < fp8.total_bytes / plain.total_bytes < 0.53


def test_unknown_architecture_is_refused_naming_it(tmp_path):
    target = tmp_path / "target"
    shutil.copytree(TINY, target, ignore=shutil.ignore_patterns("*.safetensors"))
    raw = json.loads((target / "config.json").read_text())
    (target / "config.json").write_text(json.dumps({**raw, "architectures": ["MixtralForCausalLM"]}))
    r = preflight(tiny(tmp_path, **{"target.checkpoint": str(target)}))
    assert fields(r) == ["target.checkpoint"]
    assert "['MixtralForCausalLM']" in r.problems[0] and "server.backend=local" in r.problems[0]
    sglang = preflight(tiny(tmp_path, **{"target.checkpoint": str(target), "server.backend": "sglang"}))
    assert "KimiK25ForConditionalGeneration" in sglang.problems[0]  # the supported list, from the patch set


def test_the_patch_sets_architectures_key_is_read(tmp_path):
    patches = tmp_path / "patches"
    shutil.copytree(ROOT / "patches" / "sglang", patches)
    manifest = patches / "0.5.23" / "manifest.json"
    manifest.write_text(json.dumps({**json.loads(manifest.read_text()), "architectures": ["LlamaForCausalLM"]}))
    r = preflight(tiny(tmp_path, **{"server.backend": "sglang"}), patches_dir=patches)
    assert fields(r) == ["target.checkpoint"] and "supported: LlamaForCausalLM" in r.problems[0]
    assert "architecture DeepseekV3ForCausalLM is not supported" in r.problems[0]


def test_a_missing_chat_template_is_refused_unless_the_data_is_pre_tokenized(tmp_path):
    folder = tmp_path / "tok"  # a copy of the target's small files (target.local_dir) without a template
    folder.mkdir()
    shutil.copy(TINY / "tokenizer.json", folder)
    shutil.copy(TINY / "config.json", folder)
    raw = json.loads((TINY / "tokenizer_config.json").read_text())
    template = raw.pop("chat_template")
    (folder / "tokenizer_config.json").write_text(json.dumps(raw))
    r = preflight(tiny(tmp_path, **{"target.local_dir": str(folder)}))
    assert fields(r) == ["target.local_dir"] and "no chat template" in r.problems[0]
    tokens = tmp_path / "tokens.jsonl"
    tokens.write_text("".join(json.dumps({"input_ids": [5, 6, 7, 8] * 10, "loss_mask": [0, 1] * 20}) + "\n"
                              for _ in range(40)))
    r = preflight(tiny(tmp_path, **{"target.local_dir": str(folder), "data.path": str(tokens),
                                    "data.regenerate.enabled": False}))
    assert r.ok, r.problems
    assert r.plan.data.tokens == 40 * (40 - 32) and any("pre-tokenized" in n for n in r.notes)  # 32 held out
    (folder / "chat_template.jinja").write_text(template)  # the other place a template may live
    assert has_chat_template(folder) and preflight(tiny(tmp_path, **{"target.local_dir": str(folder)})).ok


def test_bad_data_is_a_problem_naming_the_line(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(CONVERSATIONS.read_text().splitlines()[0] + "\n{not json\n")
    r = preflight(tiny(tmp_path, **{"data.path": str(bad)}))
    assert fields(r)[0] == "data.path" and f"{bad}:2:2: malformed JSON (Expecting property name" in r.problems[0]
    r = preflight(tiny(tmp_path, **{"data.path": str(tmp_path / "missing.jsonl")}))
    assert fields(r) == ["data.path"] and "not found" in r.problems[0]


def test_tokens_counted_as_prepare_counts_them_and_estimated_when_large(tmp_path):
    cfg = tiny(tmp_path)
    tok = load_tokenizer(TINY)
    records, _ = data.load_records(CONVERSATIONS, vocab_size=4096)
    prepared = data.prepare(records, tok, cfg.data, vocab_size=4096)
    exact = count_tokens(cfg.data, tok, vocab_size=4096)
    assert exact.sequences == len(prepared.train) and exact.tokens == sum(len(s.input_ids) for s in prepared.train)
    estimated = count_tokens(cfg.data, tok, vocab_size=4096, small_bytes=0)  # as if the file were large
    assert "estimated" in estimated.source and abs(estimated.tokens / exact.tokens - 1) < 0.15
    assert abs(estimated.sequences - exact.sequences) <= 1
    no_tokenizer = count_tokens(cfg.data, None, vocab_size=4096)  # the documented ratio: errs high
    assert 1.0 < no_tokenizer.tokens / exact.tokens < 1.3


def test_training_memory_matches_the_h200_measurements():
    from eyas.training.drafter import DrafterConfig

    kimi = DrafterConfig(hidden_size=7168, target_hidden_size=7168, num_attention_heads=64, num_key_value_heads=64,
                         head_dim=128, intermediate_size=18432, vocab_size=163840, draft_vocab_size=32000)
    for batch, measured_gb in [(1, 34.1), (2, 43.2), (4, 61.4), (8, 97.9)]:  # docs/performance.md
        parts = training_memory(kimi, vocab_size=163840, batch_size=batch, seq_len=4096, ttt_steps=7, bf16=True)
        assert abs(sum(v for _, v in parts) / measured_gb - 1) < 0.07, (batch, parts)
    plain, ema = (dict(training_memory(kimi, vocab_size=163840, batch_size=1, seq_len=4096, ttt_steps=7, bf16=True,
                                       ema=e)) for e in (False, True))  # training.ema_decay: 4 B a weight more
    assert ema["weights+Adam"] - plain["weights+Adam"] == pytest.approx(4 * trainable_params(kimi) / 1e9, abs=2e-3)


def test_memory_over_the_gpu_is_refused_naming_the_batch_size(tmp_path):
    cfg = tiny(tmp_path, **{"plan.gpu_memory_gb": 0.1, "training.device": "cuda"})
    r = preflight(cfg)
    assert fields(r) == ["training.batch_size"] and "plan.gpu_memory_gb=0.1" in r.problems[0]
    assert r.plan.train_memory_gb > 0.1
    assert preflight(tiny(tmp_path, **{"plan.gpu_memory_gb": 0.1, "training.device": "cpu"})).ok  # not a GPU


def test_unreachable_ssh_host_is_a_problem_not_a_crash(tmp_path, free_port):
    known = tmp_path / "known_hosts"
    known.write_text("")
    r = preflight(tiny(tmp_path, **{
        "server.backend": "sglang", "server.host": {"kind": "ssh", "hostname": "127.0.0.1", "port": free_port,
                                                    "known_hosts": str(known), "connect_timeout_s": 2},
        "target.checkpoint": str(TINY), "server.workdir": "/tmp/w", "server.dump_dir": "/tmp/d"}))
    assert fields(r) == ["server.host.hostname"] and "unreachable" in r.problems[0]


def test_cli_exit_status_and_output(tmp_path, capsys):
    args = ["preflight", str(ROOT / "configs" / "local-tiny.yaml"), "--set", f"run_dir={tmp_path}/run",
            "--set", f"extraction.output_dir={tmp_path}/shards", "--set", f"training.output_dir={tmp_path}/train"]
    assert cli(args) == 0
    out = capsys.readouterr().out
    assert "preflight: OK" in out and "shards" in out and "train " in out and "memory" in out
    assert cli([*args, "--set", "target.layer_ids=[2,4,50]"]) == 1
    out = capsys.readouterr().out
    assert "problem: target.layer_ids=[2, 4, 50]:" in out and "preflight: 1 problem(s)" in out


def test_a_warm_starts_init_from_is_checked_naming_the_field(tmp_path):
    from eyas.evaluation.export import sglang_config
    from eyas.target import read_config
    from eyas.training.train import drafter_config

    missing = preflight(tiny(tmp_path, **{"training.init_from": str(tmp_path / "old" / "drafter")}))
    assert fields(missing) == ["training.init_from"] and "does not exist" in missing.problems[0]

    cfg = tiny(tmp_path)
    tcfg = read_config(TINY)
    dcfg = drafter_config(cfg.training, tcfg, tcfg["hidden_size"], 3)
    for name, dvocab in (("fits", dcfg.draft_vocab_size), ("other", 1024)):
        folder = tmp_path / name
        folder.mkdir()
        (folder / "model.safetensors").write_bytes(b"")  # preflight reads the sizes only
        other = dcfg.__class__(**{**dcfg.__dict__, "draft_vocab_size": dvocab})
        (folder / "config.json").write_text(json.dumps(sglang_config(other, cfg.target.capture_ids(), "bfloat16", {})))
    assert preflight(tiny(tmp_path, **{"training.init_from": str(tmp_path / "fits")})).ok
    r = preflight(tiny(tmp_path, **{"training.init_from": str(tmp_path / "other")}))
    assert fields(r) == ["training.init_from"]
    assert "training.draft_vocab_size gives draft_vocab_size=2048 in this run, 1024 in the drafter" in r.problems[0]


def test_every_bad_line_is_counted_and_the_first_20_named_with_their_columns(tmp_path):
    good = CONVERSATIONS.read_text().splitlines()
    bad_lines = ['{"messages": "tab\tin a string"}'] + ["{not json"] * 24 + ['{"messages": []}']
    bad = tmp_path / "bad.jsonl"
    bad.write_text("\n".join(good[:20] + bad_lines + good[20:40]) + "\n")
    r = preflight(tiny(tmp_path, **{"data.path": str(bad)}))
    [problem] = [p for p in r.problems if p.startswith("data.path")]
    assert "26 bad line(s)" in problem and "... and 6 more" in problem
    assert f"{bad}:21:" in problem and "Invalid control character at column 18)" in problem  # not cut short
    named = [line.strip() for line in problem.splitlines()[1:] if line.strip().startswith(str(bad))]
    assert len(named) == 20 and named[1].startswith(f"{bad}:22:2: malformed JSON")
    # skip mode: preflight passes and says what it will skip, counted
    r = preflight(tiny(tmp_path, **{"data.path": str(bad), "data.bad_lines": "skip"}))
    assert not [p for p in r.problems if p.startswith("data.path")]
    assert any("26 bad line(s)" in n and "data.bad_lines: skip drops them" in n for n in r.notes)
