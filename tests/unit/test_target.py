"""eyas/target.py: the orchestrator's copy of the target (target.local_dir) and tokenizers that come
as remote code (target.trust_remote_code), with fixtures/remote-code-tokenizer: the tiny target's
small files whose tokenizer class is named by tokenizer_config.json's auto_map
(tokenization_eyas.py), as Kimi-K2.5's TikTokenTokenizer is."""

from __future__ import annotations

import json
import shutil

import pytest

from eyas.preflight import preflight
from eyas.target import (
    RemoteCodeRefused,
    load_tokenizer,
    local_copy,
    read_config,
    remote_tokenizer_class,
    target_tokenizer,
    trust_remote_code,
)
from tests.stage_config import ROOT
from tests.tiny_config import fields, tiny

TINY = ROOT / "fixtures" / "tiny-target"
REMOTE = ROOT / "fixtures" / "remote-code-tokenizer"
CHAT = [
    {"role": "user", "content": "def add(a, b):"},
    {"role": "assistant", "content": "return a + b"},
]


# ----------------------------------------------------------------------------- remote-code tokenize


def test_the_fixture_names_its_tokenizer_through_auto_map_and_has_no_tokenizer_json():
    assert remote_tokenizer_class(REMOTE) == "tokenization_eyas.EyasRemoteTokenizer"
    assert remote_tokenizer_class(TINY) is None
    assert not (REMOTE / "tokenizer.json").exists()  # nothing for transformers to fall back on
    assert read_config(REMOTE) == read_config(
        TINY
    )  # the tiny target's config: a copy of its small files


def test_a_remote_code_tokenizer_is_refused_without_trust_and_loads_with_it():
    with pytest.raises(RemoteCodeRefused, match="target.trust_remote_code: true") as e:
        load_tokenizer(REMOTE)
    assert "tokenization_eyas.EyasRemoteTokenizer" in str(e.value) and "auto_map" in str(e.value)
    tok = load_tokenizer(REMOTE, trust_remote_code=True)
    assert type(tok).__name__ == "EyasRemoteTokenizer"  # the folder's own class ran
    ours = load_tokenizer(TINY)
    assert (
        tok.apply_chat_template(CHAT, tokenize=True)["input_ids"]
        == ours.apply_chat_template(CHAT, tokenize=True)["input_ids"]
    )
    assert tok.chat_template == ours.chat_template


def test_trust_is_on_for_sglang_and_off_for_the_local_backend_unless_set(tmp_path):
    def trusted(cfg) -> bool:
        return trust_remote_code(cfg.target, cfg.server.backend)

    assert trusted(tiny(tmp_path)) is False  # local-tiny: backend local
    sglang = tiny(tmp_path, **{"server.backend": "sglang", "evaluation.method": "server"})
    assert trusted(sglang) is True  # SGLang's launch trusts the same code
    assert (
        trusted(
            tiny(
                tmp_path,
                **{
                    "server.backend": "sglang",
                    "evaluation.method": "server",
                    "target.trust_remote_code": False,
                },
            )
        )
        is False
    )
    assert trusted(tiny(tmp_path, **{"target.trust_remote_code": True})) is True


def test_every_stage_loads_the_tokenizer_from_the_local_copy_with_the_setting(tmp_path):
    from eyas.evaluation.serve_bench import heldout_prompts
    from eyas.extraction.stage import _regeneration_inputs

    plain = tiny(tmp_path)
    remote = tiny(tmp_path, **{"target.local_dir": str(REMOTE), "target.trust_remote_code": True})
    assert type(target_tokenizer(remote)).__name__ == "EyasRemoteTokenizer"
    assert heldout_prompts(remote) == heldout_prompts(
        plain
    )  # the same ids through the remote class
    assert (
        type(_regeneration_inputs(remote)[2]).__name__ == "EyasRemoteTokenizer"
    )  # prepare/regenerate
    with pytest.raises(RemoteCodeRefused):
        heldout_prompts(tiny(tmp_path, **{"target.local_dir": str(REMOTE)}))  # local backend: off


def test_preflight_checks_the_remote_code_tokenizer_and_names_the_setting(tmp_path):
    off = preflight(tiny(tmp_path, **{"target.local_dir": str(REMOTE)}))
    assert fields(off) == ["target.trust_remote_code"]
    assert "target.trust_remote_code=None (server.backend=local)" in off.problems[0]
    assert "tokenization_eyas.EyasRemoteTokenizer" in off.problems[0]
    on = preflight(
        tiny(tmp_path, **{"target.local_dir": str(REMOTE), "target.trust_remote_code": True})
    )
    assert on.ok, on.problems
    assert (
        on.plan.data.tokens == preflight(tiny(tmp_path)).plan.data.tokens
    )  # counted with the remote class


# ----------------------------------------------------------------------------- the local copy


def test_the_local_copy_is_local_dir_else_the_checkpoint(tmp_path):
    assert local_copy(tiny(tmp_path).target) == TINY
    assert local_copy(tiny(tmp_path, **{"target.local_dir": str(REMOTE)}).target) == REMOTE


def test_an_ssh_server_host_without_a_local_copy_is_a_problem_naming_local_dir(tmp_path):
    host = {
        "kind": "ssh",
        "name": "node",
        "hostname": "gpu-node-1",
        "insecure_accept_any_host_key": True,
    }
    remote = {
        "server.backend": "sglang",
        "evaluation.method": "server",
        "server.host": host,
        "target.checkpoint": "/models/not-here",
        "server.workdir": "/tmp/w",
        "server.dump_dir": "/tmp/d",
    }
    r = preflight(tiny(tmp_path, **remote), check_hosts=False)
    assert "target.checkpoint" in fields(r)
    problem = r.problems[fields(r).index("target.checkpoint")]
    assert "/models/not-here/config.json" in problem and "set target.local_dir" in problem
    copy = tmp_path / "copy"
    shutil.copytree(
        TINY, copy, ignore=shutil.ignore_patterns("*.safetensors")
    )  # the small files only
    r = preflight(tiny(tmp_path, **remote, **{"target.local_dir": str(copy)}), check_hosts=False)
    assert not any(f.startswith("target.") for f in fields(r)), r.problems
    assert not any("target.local_dir=None" in n for n in r.notes)
    shared = preflight(
        tiny(tmp_path, **{**remote, "target.checkpoint": str(TINY)}), check_hosts=False
    )
    assert any(
        "target.local_dir=None" in n and str(TINY) in n for n in shared.notes
    )  # a path both see


def test_the_export_checks_the_drafter_against_the_local_copy(random_target, tmp_path):
    """export_drafter reads the target's config from target.local_dir, not from the server's
    path."""
    from eyas.config import ExportConfig
    from eyas.evaluation.export import export_drafter
    from eyas.training.train import train_drafter
    from tests.helpers_training import shard_meta, target_config, training_config, write_shards

    shards = write_shards(random_target, tmp_path / "shards", num_shards=1, per_shard=6, length=16)
    trained = train_drafter(
        training_config(tmp_path / "train", max_steps=1),
        target_config(random_target),
        shards,
        log=lambda _: None,
    )
    copy = tmp_path / "copy"
    copy.mkdir()
    raw = json.loads((random_target / "config.json").read_text())
    (copy / "config.json").write_text(json.dumps({**raw, "hidden_size": raw["hidden_size"] * 2}))
    elsewhere = target_config(random_target).model_copy(
        update={"checkpoint": tmp_path / "on-the-node"}
    )
    with pytest.raises(ValueError, match=f"refusing to export.*{copy}"):
        export_drafter(
            trained,
            tmp_path / "d1",
            target=elsewhere.model_copy(update={"local_dir": copy}),
            export=ExportConfig(),
            shard_meta=shard_meta(),
        )
    (copy / "config.json").write_text(json.dumps(raw))
    out = export_drafter(
        trained,
        tmp_path / "d2",
        target=elsewhere.model_copy(update={"local_dir": copy}),
        export=ExportConfig(),
        shard_meta=shard_meta(),
    )
    assert json.loads((out / "config.json").read_text())["eyas"]["target_checkpoint"] == str(
        tmp_path / "on-the-node"
    )


def test_a_long_line_gets_no_line_less_length_warning_from_the_tokenizer(capfd, caplog, request):
    """transformers warns "Token indices sequence length is longer ..." without naming the line;
    eyas's data checks name it (file:line) instead, so the tokenizer eyas loads stays quiet."""
    from transformers import AutoTokenizer
    from transformers.utils import logging as hf_logging

    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_warning()  # other tests may have quieted transformers for the session
    request.addfinalizer(lambda: hf_logging.set_verbosity(level))

    def printed() -> str:  # transformers' own handler (stderr) or, under pytest, the log capture
        text = capfd.readouterr().err + caplog.text
        caplog.clear()
        return text

    folder = ROOT / "fixtures" / "tiny-target"
    messages = [{"role": "user", "content": "word " * 3000}, {"role": "assistant", "content": "ok"}]
    plain = AutoTokenizer.from_pretrained(str(folder))
    plain.model_max_length = 64
    plain.apply_chat_template(messages, tokenize=True)
    assert "Token indices sequence length is longer" in printed()  # what it would print
    tok = load_tokenizer(folder)
    tok.model_max_length = 64
    tok.apply_chat_template(messages, tokenize=True)
    assert "Token indices sequence length" not in printed()
