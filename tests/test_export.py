import json

import pytest
import torch
import transformers
from safetensors import safe_open

from eyas.config import ExportConfig
from eyas.drafter import DrafterConfig, Eagle3Drafter, causal_mask
from eyas.export import check_layer_ids, export_drafter, load_exported
from eyas.target_head import load_target_tensors
from eyas.train import train_drafter
from tests.helpers_training import shard_meta, target_config, training_config, write_shards

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def trained(random_target, tmp_path_factory):
    shards = write_shards(random_target, tmp_path_factory.mktemp("shards"), num_shards=1, per_shard=6, length=16)
    cfg = training_config(tmp_path_factory.mktemp("train"), max_steps=3)
    return train_drafter(cfg, target_config(random_target), shards, log=lambda _: None)


def export(trained, random_target, out, dtype="bfloat16", **kw):
    tgt = kw.pop("target", target_config(random_target))
    return export_drafter(trained, out, target=tgt, export=ExportConfig(dtype=dtype),
                          shard_meta=kw.pop("meta", shard_meta()))


def test_sglang_names_shapes_dtypes_and_config(trained, random_target, tmp_path):
    out = export(trained, random_target, tmp_path / "drafter")
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"] and cfg["model_type"] == "llama"
    assert cfg["num_hidden_layers"] == 1 and cfg["tie_word_embeddings"] is False
    assert (cfg["hidden_size"], cfg["target_hidden_size"], cfg["vocab_size"], cfg["draft_vocab_size"]) == (64, 64, 512, 256)
    assert cfg["eagle_config"] == {"eagle_aux_hidden_state_layer_ids": [2, 4, 5], "use_aux_hidden_state": True}
    H, nh, hd, inter = 64, cfg["num_attention_heads"], cfg["head_dim"], cfg["intermediate_size"]
    assert (nh, cfg["num_key_value_heads"], hd, inter) == (4, 4, 16, 128)  # from the target's config
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        t = {k: f.get_tensor(k) for k in f.keys()}
    want = {"fc.weight": [H, 3 * H], "norm.weight": [H], "lm_head.weight": [256, H], "d2t": [256], "t2d": [512],
            "midlayer.self_attn.q_proj.weight": [nh * hd, 2 * H], "midlayer.self_attn.k_proj.weight": [nh * hd, 2 * H],
            "midlayer.self_attn.v_proj.weight": [nh * hd, 2 * H], "midlayer.self_attn.o_proj.weight": [H, nh * hd],
            "midlayer.mlp.gate_proj.weight": [inter, H], "midlayer.mlp.up_proj.weight": [inter, H],
            "midlayer.mlp.down_proj.weight": [H, inter], "midlayer.input_layernorm.weight": [H],
            "midlayer.hidden_norm.weight": [H], "midlayer.post_attention_layernorm.weight": [H]}
    assert {k: list(v.shape) for k, v in t.items()} == want  # no embed_tokens, no fused qkv/gate_up
    assert t["d2t"].dtype == torch.int64 and t["t2d"].dtype == torch.bool
    assert all(v.dtype == torch.bfloat16 for k, v in t.items() if k not in ("d2t", "t2d"))
    hot = t["d2t"] + torch.arange(256)  # what SGLang computes as hot_token_id
    assert torch.equal(hot, t["t2d"].nonzero().flatten())
    llama = transformers.LlamaConfig.from_pretrained(str(out))  # SGLang parses it as a LlamaConfig
    assert (llama.hidden_size, llama.num_hidden_layers, llama.head_dim, llama.tie_word_embeddings) == (64, 1, 16, False)
    assert llama.draft_vocab_size == 256 and llama.rope_parameters["rope_theta"] == cfg["rope_theta"]


def test_reload_gives_the_trained_drafter(trained, random_target, tmp_path):
    ck = trained.checkpoint_dir
    dcfg = DrafterConfig(**json.loads(open(f"{ck}/drafter.json").read())["drafter"])
    ref = Eagle3Drafter(dcfg)
    from safetensors.torch import load_file
    ref.load_state_dict({**load_file(f"{ck}/model.safetensors"),
                         "embed_tokens.weight": load_target_tensors(random_target, ["embed"])["embed"]})
    ids, aux = torch.randint(0, 512, (1, 7)), torch.randn(1, 7, 192)
    with torch.no_grad():
        want = ref(ids, aux, torch.arange(7), causal_mask(7))[0]
        for dtype, tol in [("float32", 0.0), ("bfloat16", 0.05)]:
            model, d2t, meta = load_exported(export(trained, random_target, tmp_path / dtype, dtype=dtype))
            assert torch.equal(d2t, ref.d2t) and meta["torch_dtype"] == dtype
            got = model(ids, aux, torch.arange(7), causal_mask(7))[0]
            torch.testing.assert_close(got, want, atol=tol, rtol=tol)


def test_layer_ids_are_checked_before_export(trained, random_target, tmp_path):
    out = tmp_path / "d"
    with pytest.raises(ValueError, match="does not record layer_ids"):
        export(trained, random_target, out, meta={"last_hidden_norm": "post"})
    with pytest.raises(ValueError, match=r"captured at layers \[3, 5, 6\]"):
        export(trained, random_target, out, meta=shard_meta(layer_ids=[2, 4, 5], convention="output-of"))
    other = target_config(random_target, layer_ids=[3, 4, 5])
    with pytest.raises(ValueError, match=r"trained on capture layers \[2, 4, 5\]"):
        export(trained, random_target, out, target=other, meta=shard_meta(layer_ids=[3, 4, 5]))
    contradictory = {**shard_meta(), "capture_ids": [3, 5, 6]}
    with pytest.raises(ValueError, match="contradicts itself"):
        export(trained, random_target, out, meta=contradictory)
    assert not out.exists()
    starts_at_1 = target_config(random_target, layer_ids=[1, 4, 5])
    with pytest.raises(ValueError, match="start with 1"):
        check_layer_ids(starts_at_1, shard_meta(layer_ids=[1, 4, 5]))
    past_the_end = target_config(random_target, layer_ids=[2, 4, 8])
    with pytest.raises(ValueError, match="not the input of any"):
        check_layer_ids(past_the_end, shard_meta(layer_ids=[2, 4, 8]), num_target_layers=8)


def test_output_of_config_exports_capture_before_ids(trained, random_target, tmp_path):
    tgt = target_config(random_target, layer_ids=[1, 3, 4], convention="output-of")
    out = export(trained, random_target, tmp_path / "d", target=tgt,
                 meta=shard_meta(layer_ids=[1, 3, 4], convention="output-of"))
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5]  # SGLang takes it as is


def test_reexport_replaces_the_folder_whole(trained, random_target, tmp_path):
    out = export(trained, random_target, tmp_path / "d", dtype="float32")
    (out / "stale.txt").write_text("x")
    export(trained, random_target, out, dtype="bfloat16")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d"]
    assert not (out / "stale.txt").exists()
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "bfloat16"
