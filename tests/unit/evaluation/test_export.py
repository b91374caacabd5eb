import ast
import json
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path
from typing import Iterable, Tuple

import pytest
import torch
import transformers
from safetensors import safe_open

from eyas.config import ExportConfig
from eyas.dump import DTYPES
from eyas.evaluation.export import check_layer_ids, export_drafter, load_exported
from eyas.training.drafter import DrafterConfig, Eagle3Drafter, causal_mask
from eyas.training.target_head import load_target_tensors
from eyas.training.train import train_drafter
from tests.helpers_training import shard_meta, target_config, training_config, write_shards

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def trained(random_target, tmp_path_factory):
    shards = write_shards(
        random_target, tmp_path_factory.mktemp("shards"), num_shards=1, per_shard=6, length=16
    )
    cfg = training_config(tmp_path_factory.mktemp("train"), max_steps=3)
    return train_drafter(cfg, target_config(random_target), shards, log=lambda _: None)


def export(trained, random_target, out, dtype="bfloat16", **kw):
    tgt = kw.pop("target", target_config(random_target))
    return export_drafter(
        trained,
        out,
        target=tgt,
        export=ExportConfig(dtype=dtype),
        shard_meta=kw.pop("meta", shard_meta()),
    )


def test_sglang_names_shapes_dtypes_and_config(trained, random_target, tmp_path):
    out = export(trained, random_target, tmp_path / "drafter")
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"] and cfg["model_type"] == "llama"
    assert cfg["num_hidden_layers"] == 1 and cfg["tie_word_embeddings"] is False
    assert (
        cfg["hidden_size"],
        cfg["target_hidden_size"],
        cfg["vocab_size"],
        cfg["draft_vocab_size"],
    ) == (64, 64, 512, 256)
    assert cfg["eagle_config"] == {
        "eagle_aux_hidden_state_layer_ids": [2, 4, 5],
        "use_aux_hidden_state": True,
    }
    H, nh, hd, inter = 64, cfg["num_attention_heads"], cfg["head_dim"], cfg["intermediate_size"]
    assert (nh, cfg["num_key_value_heads"], hd, inter) == (
        4,
        4,
        16,
        128,
    )  # from the target's config
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        t = {k: f.get_tensor(k) for k in f.keys()}
    want = {
        "fc.weight": [H, 3 * H],
        "norm.weight": [H],
        "lm_head.weight": [256, H],
        "d2t": [256],
        "t2d": [512],
        "midlayer.self_attn.q_proj.weight": [nh * hd, 2 * H],
        "midlayer.self_attn.k_proj.weight": [nh * hd, 2 * H],
        "midlayer.self_attn.v_proj.weight": [nh * hd, 2 * H],
        "midlayer.self_attn.o_proj.weight": [H, nh * hd],
        "midlayer.mlp.gate_proj.weight": [inter, H],
        "midlayer.mlp.up_proj.weight": [inter, H],
        "midlayer.mlp.down_proj.weight": [H, inter],
        "midlayer.input_layernorm.weight": [H],
        "midlayer.hidden_norm.weight": [H],
        "midlayer.post_attention_layernorm.weight": [H],
    }
    assert {k: list(v.shape) for k, v in t.items()} == want  # no embed_tokens, no fused qkv/gate_up
    assert t["d2t"].dtype == torch.int64 and t["t2d"].dtype == torch.bool
    assert all(v.dtype == torch.bfloat16 for k, v in t.items() if k not in ("d2t", "t2d"))
    hot = t["d2t"] + torch.arange(256)  # what SGLang computes as hot_token_id
    assert torch.equal(hot, t["t2d"].nonzero().flatten())
    llama = transformers.LlamaConfig.from_pretrained(str(out))  # SGLang parses it as a LlamaConfig
    assert (
        llama.hidden_size,
        llama.num_hidden_layers,
        llama.head_dim,
        llama.tie_word_embeddings,
    ) == (64, 1, 16, False)
    assert (
        llama.draft_vocab_size == 256 and llama.rope_parameters["rope_theta"] == cfg["rope_theta"]
    )


def test_reload_gives_the_trained_drafter(trained, random_target, tmp_path):
    ck = trained.checkpoint_dir
    dcfg = DrafterConfig(**json.loads(open(f"{ck}/drafter.json").read())["drafter"])
    ref = Eagle3Drafter(dcfg)
    from safetensors.torch import load_file

    ref.load_state_dict(
        {
            **load_file(f"{ck}/model.safetensors"),
            "embed_tokens.weight": load_target_tensors(random_target, ["embed"])["embed"],
        }
    )
    ids, aux = torch.randint(0, 512, (1, 7)), torch.randn(1, 7, 192)
    with torch.no_grad():
        want = ref(ids, aux, torch.arange(7), causal_mask(7))[0]
        for dtype, tol in [("float32", 0.0), ("bfloat16", 0.05)]:
            model, d2t, meta = load_exported(
                export(trained, random_target, tmp_path / dtype, dtype=dtype)
            )
            assert torch.equal(d2t, ref.d2t) and meta["torch_dtype"] == dtype
            got = model(ids, aux, torch.arange(7), causal_mask(7))[0]
            torch.testing.assert_close(got, want, atol=tol, rtol=tol)


def test_layer_ids_are_checked_before_export(trained, random_target, tmp_path):
    out = tmp_path / "d"
    with pytest.raises(ValueError, match="does not record layer_ids"):
        export(trained, random_target, out, meta={"last_hidden_norm": "post"})
    with pytest.raises(ValueError, match=r"captured at layers \[3, 5, 6\]"):
        export(
            trained,
            random_target,
            out,
            meta=shard_meta(layer_ids=[2, 4, 5], convention="output-of"),
        )
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
    out = export(
        trained,
        random_target,
        tmp_path / "d",
        target=tgt,
        meta=shard_meta(layer_ids=[1, 3, 4], convention="output-of"),
    )
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [
        2,
        4,
        5,
    ]  # SGLang takes it as is


def test_reexport_replaces_the_folder_whole(trained, random_target, tmp_path):
    out = export(trained, random_target, tmp_path / "d", dtype="float32")
    (out / "stale.txt").write_text("x")
    export(trained, random_target, out, dtype="bfloat16")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d"]
    assert not (out / "stale.txt").exists()
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "bfloat16"


# ----------------------------------------------------------------------------- SGLang 0.5.23's load

SGLANG = "0.5.23"
WHEELS = Path.home() / ".cache" / "eyas-test" / "wheels"


@pytest.fixture(scope="module")
def sglang_eagle3_source() -> str:
    """models/llama_eagle3.py from the sglang 0.5.23 wheel (cached by the patch tests, else
    fetched)."""
    found = sorted(WHEELS.glob(f"sglang-{SGLANG}-*.whl"))
    if not found:
        r = subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "download",
                f"sglang=={SGLANG}",
                "--no-deps",
                "-d",
                str(WHEELS),
            ],
            capture_output=True,
            timeout=900,
        )
        found = sorted(WHEELS.glob(f"sglang-{SGLANG}-*.whl"))
        if r.returncode or not found:
            pytest.skip(f"sglang {SGLANG} wheel not cached in {WHEELS} and not downloadable")
    with zipfile.ZipFile(found[0]) as z:
        return z.read("sglang/srt/models/llama_eagle3.py").decode()


def sglang_load_weights(source: str):
    """LlamaForCausalLMEagle3.load_weights, its source taken verbatim from the wheel."""
    tree = ast.parse(source)
    cls = next(
        n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "LlamaForCausalLMEagle3"
    )
    fn = next(n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == "load_weights")
    ns = {
        "torch": torch,
        "Iterable": Iterable,
        "Tuple": Tuple,
        "default_weight_loader": _default_weight_loader,
    }
    exec(textwrap.dedent(ast.get_source_segment(source, fn)), ns)  # noqa: S102 - SGLang's own code
    return ns["load_weights"]


def _default_weight_loader(param, loaded_weight):  # sglang.srt.model_loader.weight_utils, at tp 1
    assert param.size() == loaded_weight.size(), (param.size(), loaded_weight.size())
    param.data.copy_(loaded_weight)
    param.written[:] = True


def _sharded(param, offsets: dict):
    """The weight_loader of a fused column-parallel layer at tp 1: shard_id -> rows [a, b)."""

    def load(p, loaded_weight, shard_id):
        a, b = offsets[shard_id]
        assert list(loaded_weight.shape) == [b - a, p.shape[1]], (
            shard_id,
            loaded_weight.shape,
            p.shape,
        )
        p.data[a:b].copy_(loaded_weight)
        p.written[a:b] = True

    param.weight_loader = load


class FakeSGLangDrafter:
    """The parameters LlamaForCausalLMEagle3 builds for a config.json (its __init__ and
    LlamaModel's)."""

    def __init__(self, cfg: dict):
        H, nh, nkv, hd, inter = (
            cfg["hidden_size"],
            cfg["num_attention_heads"],
            cfg["num_key_value_heads"],
            cfg["head_dim"],
            cfg["intermediate_size"],
        )
        # the config rules LlamaModel.__init__ applies (llama_eagle3.py, class LlamaModel)
        assert cfg.get("num_aux_hidden_states") is None and not cfg.get("norm_before_fc")
        assert (
            not cfg.get("fc_norm")
            and not cfg.get("use_aux_norm")
            and not cfg["tie_word_embeddings"]
        )
        assert cfg["draft_vocab_size"] is not None  # None would reuse the target's lm_head
        num_aux = len(cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"])
        shapes = {
            "model.embed_tokens.weight": [cfg["vocab_size"], H],
            "model.fc.weight": [H, cfg.get("target_hidden_size", H) * num_aux],
            "model.layers.0.self_attn.qkv_proj.weight": [(nh + 2 * nkv) * hd, 2 * H],
            "model.layers.0.self_attn.o_proj.weight": [H, nh * hd],
            "model.layers.0.mlp.gate_up_proj.weight": [2 * inter, H],
            "model.layers.0.mlp.down_proj.weight": [H, inter],
            "model.layers.0.input_layernorm.weight": [H],
            "model.layers.0.hidden_norm.weight": [H],
            "model.layers.0.post_attention_layernorm.weight": [H],
            "model.norm.weight": [H],
            "lm_head.weight": [cfg["draft_vocab_size"], H],
        }
        self.params = {
            n: torch.nn.Parameter(
                torch.full(s, float("nan"), dtype=DTYPES[cfg["torch_dtype"]]), requires_grad=False
            )
            for n, s in shapes.items()
        }
        for p in self.params.values():
            p.written = torch.zeros(p.shape[0], dtype=torch.bool)
        _sharded(
            self.params["model.layers.0.self_attn.qkv_proj.weight"],
            {
                "q": (0, nh * hd),
                "k": (nh * hd, (nh + nkv) * hd),
                "v": ((nh + nkv) * hd, (nh + 2 * nkv) * hd),
            },
        )
        _sharded(
            self.params["model.layers.0.mlp.gate_up_proj.weight"],
            {0: (0, inter), 1: (inter, 2 * inter)},
        )
        self.hot_token_id = None

    def named_parameters(self):
        return iter(self.params.items())


def test_sglang_0_5_23_loads_every_weight_and_reads_d2t_as_offsets(
    trained, random_target, tmp_path, sglang_eagle3_source
):
    out = export(trained, random_target, tmp_path / "drafter")
    cfg = json.loads((out / "config.json").read_text())
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        weights = {k: f.get_tensor(k) for k in f.keys()}
    model = FakeSGLangDrafter(cfg)
    sglang_load_weights(sglang_eagle3_source)(model, iter(weights.items()))
    unwritten = [
        n
        for n, p in model.params.items()
        if not p.written.all() and n != "model.embed_tokens.weight"
    ]
    assert not unwritten, (
        f"SGLang would leave these uninitialised (a name it skips silently): {unwritten}"
    )
    assert not model.params["model.embed_tokens.weight"].written.any()  # comes from the target
    p = model.params
    qkv = torch.cat([weights[f"midlayer.self_attn.{n}_proj.weight"] for n in "qkv"])
    assert torch.equal(p["model.layers.0.self_attn.qkv_proj.weight"], qkv)
    gate_up = torch.cat(
        [weights["midlayer.mlp.gate_proj.weight"], weights["midlayer.mlp.up_proj.weight"]]
    )
    assert torch.equal(p["model.layers.0.mlp.gate_up_proj.weight"], gate_up)
    assert torch.equal(p["lm_head.weight"], weights["lm_head.weight"])
    assert torch.equal(p["model.fc.weight"], weights["fc.weight"])
    # hot_token_id = d2t + arange: the target id of each draft id, exactly the tokens t2d marks
    assert model.hot_token_id.dtype == torch.int64
    assert torch.equal(model.hot_token_id, weights["t2d"].nonzero().flatten())
    assert weights["d2t"].dtype == torch.int64 and all(
        v.dtype == torch.bfloat16 for k, v in weights.items() if k not in ("d2t", "t2d")
    )
