"""eyas's two target fixtures carry every config attribute real SGLang 0.5.23 reads when it loads
them.

Real SGLang refused fixtures/tiny-target (`'DeepseekV3Config' object has no attribute
'topk_method'`, deepseek_v2.py:519) although eyas's own server, built on transformers, loads it. A
list of required keys kept by hand would drift from SGLang's code, so this test reads the wheel's
model source (the `sglang_wheel` fixture downloads sglang 0.5.23 and skips when it cannot) and
collects, with `ast`, every attribute read on a config object (`config.x`, `self.config.x`,
`hf_config.x`, `text_config.x`, `self.hf_text_config.x`) in the files SGLang runs to load and serve
these architectures:

- `srt/models/deepseek_v2.py`: DeepseekV2/V3ForCausalLM, their attention, MoE gate and experts,
decoder
  layers (every `config` there is the DeepSeek-V3 text config);
- `srt/models/deepseek_common/deepseek_weight_loader.py`: the weight loading mixin of those classes;
- `srt/models/kimi_k25.py`: KimiK25ForConditionalGeneration (the top-level config), its MoonViT
tower
  and projector (the vision config), and the DeepSeek-V3 language model it wraps (`text_config`);
- `srt/configs/model_config.py`, only the MLA branch of ModelConfig that DeepSeek-V3 and Kimi-K2.5
take
  (the `if` naming DeepseekV3ForCausalLM in its test): the rest of that file reads other
  architectures' fields behind their own architecture tests, and generic fields every config has.

A read counts when it is unguarded on this config: not under `hasattr(config, "x")` /
`getattr(config, "x", ...)` naming the same attribute (getattr reads with a default are calls, not
reads, and are never collected), not in a `try` that catches AttributeError; a read in a branch that
runs only when another attribute exists (or is missing) counts when the fixture's config takes that
branch. Each counted read must exist on the config object SGLang would build from the fixture:
transformers' DeepseekV3Config for the tiny target and Kimi's text_config (defaults included, as
SGLang sees them; SGLang 0.5.23 pins transformers 5.19, this environment has the one in its lock),
the wheel's own KimiK25Config (srt/configs/kimi_k25.py) for Kimi's top level and its vision config.

NOT_ON_EYAS_PATH lists the few unguarded reads that sit behind a module flag or a quantization this
path never takes, each with why; a new read in a later wheel fails here until the fixtures have it
or it is listed with a reason.
"""

from __future__ import annotations

import ast
import importlib.util
import json
import zipfile
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.stage_config import ROOT

TINY = ROOT / "fixtures" / "tiny-target"
KIMI = ROOT / "fixtures" / "kimi-k2.5"

DSV2 = "sglang/srt/models/deepseek_v2.py"
LOADER = "sglang/srt/models/deepseek_common/deepseek_weight_loader.py"
KIMI_K25 = "sglang/srt/models/kimi_k25.py"
MODEL_CONFIG = "sglang/srt/configs/model_config.py"
KIMI_CONFIG = "sglang/srt/configs/kimi_k25.py"

CONFIG_NAMES = {"config", "hf_config", "text_config", "hf_text_config"}
ISA = "isinstance:"  # a fact "the config is of this class", beside the hasattr facts
# kimi_k25.py: the classes built from the vision config
# (MoonViT3dPretrainedModel(config.vision_config), K2VLMultiModalProjector(config.vision_config));
# everything else there is the top level or text_config.
KIMI_VISION_CLASSES = {"MoonViT3dPretrainedModel", "K2VLMultiModalProjector"}

#: (file, attribute): why the read never runs when SGLang serves these fixtures as eyas launches
#: them.
NOT_ON_EYAS_PATH = {
    (DSV2, "quantization_config"): "read only under `_use_aiter` (ROCm) with FP8 shared experts; "
    "the tiny "
    "target is bf16 and a quantization_config would make SGLang "
    "quantize it",
}


@dataclass(frozen=True)
class Read:
    file: str
    line: int
    attr: str
    scope: str  #: "text", "top" or "vision": which of the fixture's config objects it reads
    requires: tuple[tuple[str, bool], ...]  #: (attribute, present?) the branch needs to run


def _base(node: ast.Attribute) -> str | None:
    v = node.value
    if isinstance(v, ast.Name) and v.id in CONFIG_NAMES:
        return v.id
    if (
        isinstance(v, ast.Attribute)
        and v.attr in CONFIG_NAMES
        and isinstance(v.value, ast.Name)
        and v.value.id == "self"
    ):
        return v.attr
    return None


def _facts(test: ast.expr) -> list[tuple[str, bool]]:
    """hasattr/getattr(<config>, "x", ...) facts a true `test` establishes: [("x", True)], negated
    by not."""
    if isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not):
        inner = _facts(test.operand)
        return [(n, not p) for n, p in inner] if len(inner) == 1 else []
    if isinstance(test, ast.BoolOp) and isinstance(test.op, ast.And):
        return [f for v in test.values for f in _facts(v)]
    if (
        isinstance(test, ast.Compare) and len(test.ops) == 1
    ):  # getattr(config, "x", None) is not None
        return _facts(test.left) if isinstance(test.ops[0], ast.IsNot) else []
    if (
        isinstance(test, ast.Call)
        and isinstance(test.func, ast.Name)
        and test.func.id in ("hasattr", "getattr")
        and len(test.args) >= 2
        and isinstance(test.args[1], ast.Constant)
        and isinstance(test.args[1].value, str)
    ):
        obj = test.args[0]
        if (isinstance(obj, ast.Name) and obj.id in CONFIG_NAMES) or (
            isinstance(obj, ast.Attribute) and obj.attr in CONFIG_NAMES
        ):
            return [(test.args[1].value, True)]
    if (
        isinstance(test, ast.Call)
        and isinstance(test.func, ast.Name)
        and test.func.id == "isinstance"
        and len(test.args) == 2
        and isinstance(test.args[1], ast.Name)
        and (
            (isinstance(test.args[0], ast.Name) and test.args[0].id in CONFIG_NAMES)
            or (isinstance(test.args[0], ast.Attribute) and test.args[0].attr in CONFIG_NAMES)
        )
    ):
        return [(ISA + test.args[1].id, True)]  # a branch for one config class (Dots3Config, ...)
    return []


def _catches_attribute_error(node: ast.Try) -> bool:
    for h in node.handlers:
        names = [h.type] if not isinstance(h.type, ast.Tuple) else list(h.type.elts)
        if h.type is None or any(
            isinstance(n, ast.Name) and n.id in ("AttributeError", "Exception") for n in names
        ):
            return True
    return False


def config_reads(
    source: str, file: str, scope_of=lambda cls, base: "text", pick=None
) -> list[Read]:
    """Every attribute read on a config object in `source`, with the hasattr branches it sits in.
    scope_of(enclosing class, base name) says which config object it is; pick(tree) the statements
    to read (default: the whole file)."""
    out: list[Read] = []

    def visit(node, requires: tuple, cls: str | None, guarded: bool):
        if isinstance(node, ast.ClassDef):
            cls = node.name
        if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load) and not guarded:
            base = _base(node)
            if base and not node.attr.startswith("__"):
                out.append(Read(file, node.lineno, node.attr, scope_of(cls, base), requires))
        if isinstance(node, (ast.If, ast.IfExp, ast.While)):
            facts = tuple(_facts(node.test))
            visit(node.test, requires, cls, guarded)
            for child in node.body if isinstance(node.body, list) else [node.body]:
                visit(child, requires + facts, cls, guarded)
            negated = ((facts[0][0], not facts[0][1]),) if len(facts) == 1 else ()
            for child in node.orelse if isinstance(node.orelse, list) else [node.orelse]:
                visit(child, requires + negated, cls, guarded)
            return
        if isinstance(node, ast.BoolOp):
            so_far: tuple = ()
            for v in node.values:
                visit(v, requires + so_far, cls, guarded)
                f = tuple(_facts(v))
                so_far += (
                    f
                    if isinstance(node.op, ast.And)
                    else tuple((n, not p) for n, p in f[:1] if len(f) == 1)
                )
            return
        if isinstance(node, ast.Try) and _catches_attribute_error(node):
            for child in node.body:
                visit(child, requires, cls, True)
            for child in [*node.handlers, *node.orelse, *node.finalbody]:
                visit(child, requires, cls, guarded)
            return
        for child in ast.iter_child_nodes(node):
            visit(child, requires, cls, guarded)

    tree = ast.parse(source)
    for root in [tree] if pick is None else pick(tree):
        visit(root, (), None, False)
    return out


def _mla_branch(tree: ast.Module) -> list[ast.stmt]:
    """The body of ModelConfig's `if` whose test names both DeepseekV3ForCausalLM and Kimi-K2.5."""
    names = {"DeepseekV3ForCausalLM", "KimiK25ForConditionalGeneration"}
    found = [
        n
        for n in ast.walk(tree)
        if isinstance(n, ast.If)
        and names <= {c.value for c in ast.walk(n.test) if isinstance(c, ast.Constant)}
    ]
    assert len(found) == 1, (
        f"{MODEL_CONFIG}: the DeepSeek-V3 MLA branch moved ({len(found)} found): update this test"
    )
    return found[0].body  # the branch's own body, not the elif chain after it


def wheel_reads(wheel: Path) -> list[Read]:
    with zipfile.ZipFile(wheel) as z:
        text = {name: z.read(name).decode() for name in (DSV2, LOADER, KIMI_K25, MODEL_CONFIG)}
    reads = config_reads(text[DSV2], DSV2) + config_reads(text[LOADER], LOADER)
    reads += config_reads(
        text[KIMI_K25],
        KIMI_K25,
        scope_of=lambda cls, base: (
            "vision" if cls in KIMI_VISION_CLASSES else "text" if base == "text_config" else "top"
        ),
    )
    reads += config_reads(
        text[MODEL_CONFIG],
        MODEL_CONFIG,
        pick=_mla_branch,
        scope_of=lambda cls, base: "text" if base == "hf_text_config" else "top",
    )
    return reads


def model_config_sets(wheel: Path) -> set[str]:
    """The attributes ModelConfig.__init__ itself assigns on every hf_config (encoder_only,
    language_only, ...): statements straight in its body, so they are set whatever the model."""
    with zipfile.ZipFile(wheel) as z:
        tree = ast.parse(z.read(MODEL_CONFIG).decode())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "ModelConfig")
    init = next(n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == "__init__")
    return {
        t.attr
        for stmt in init.body
        if isinstance(stmt, ast.Assign)
        for t in stmt.targets
        if isinstance(t, ast.Attribute)
        and isinstance(t.value, ast.Attribute)
        and t.value.attr == "hf_config"
    }


def as_sglang_sets_it(config, wheel: Path):
    """The top-level config after ModelConfig's own assignments (their values do not matter
    here)."""
    for name in model_config_sets(wheel):
        if not hasattr(config, name):
            setattr(config, name, False)
    return config


def _kimi_config_class(wheel: Path, tmp_path: Path):
    """SGLang's own KimiK25Config, from the wheel (it imports only transformers)."""
    path = tmp_path / "sglang_kimi_k25_config.py"
    with zipfile.ZipFile(wheel) as z:
        path.write_bytes(z.read(KIMI_CONFIG))
    spec = importlib.util.spec_from_file_location("sglang_kimi_k25_config", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.KimiK25Config


def _holds(obj, fact: str) -> bool:
    if fact.startswith(ISA):
        return fact[len(ISA) :] in {c.__name__ for c in type(obj).__mro__}
    return hasattr(obj, fact)


def missing_reads(reads: list[Read], configs: dict[str, object], files: set[str]) -> list[str]:
    """The counted reads (see the module docstring) the given config objects lack, as file:line:
    attr."""
    missing = []
    for r in reads:
        if r.file not in files or (r.file, r.attr) in NOT_ON_EYAS_PATH:
            continue
        obj = configs[r.scope]
        if any(name == r.attr and present for name, present in r.requires):
            continue  # guarded by hasattr/getattr on the same attribute
        if any(_holds(obj, name) != present for name, present in r.requires):
            continue  # a branch this config does not take
        if not hasattr(obj, r.attr):
            missing.append(f"{r.file}:{r.line}: {r.scope} config has no {r.attr}")
    return sorted(set(missing))


@pytest.fixture(scope="module")
def reads(sglang_wheel):
    found = wheel_reads(sglang_wheel)
    # The reads the issue names are collected and not counted as guarded: the scan sees what SGLang
    # does.
    names = {r.attr for r in found if r.file == DSV2 and not r.requires}
    assert {"topk_method", "scoring_func", "moe_layer_freq", "n_routed_experts"} <= names
    return found


def test_the_tiny_target_has_every_attribute_sglangs_deepseek_code_reads(reads, sglang_wheel):
    from transformers import AutoConfig, DeepseekV3Config

    config = AutoConfig.from_pretrained(TINY)  # what SGLang's get_config builds for deepseek_v3
    assert isinstance(config, DeepseekV3Config)
    config = as_sglang_sets_it(config, sglang_wheel)
    missing = missing_reads(reads, {"text": config}, {DSV2, LOADER, MODEL_CONFIG})
    assert not missing, "fixtures/tiny-target/config.json lacks what SGLang reads:\n" + "\n".join(
        missing
    )
    # The values a real DeepSeek-V3 config has, and what transformers' DeepseekV3 routing computes.
    assert (config.topk_method, config.scoring_func, config.moe_layer_freq) == (
        "noaux_tc",
        "sigmoid",
        1,
    )


def test_the_kimi_fixture_has_every_attribute_sglangs_kimi_code_reads(
    reads, sglang_wheel, tmp_path
):
    raw = json.loads((KIMI / "config.json").read_text())
    top = _kimi_config_class(sglang_wheel, tmp_path)(
        **{k: v for k, v in raw.items() if k != "model_type"}
    )
    top = as_sglang_sets_it(top, sglang_wheel)
    assert {"encoder_only", "language_only"} <= model_config_sets(sglang_wheel)
    configs = {"top": top, "text": top.text_config, "vision": top.vision_config}
    missing = missing_reads(reads, configs, {DSV2, LOADER, KIMI_K25, MODEL_CONFIG})
    assert not missing, "fixtures/kimi-k2.5/config.json lacks what SGLang reads:\n" + "\n".join(
        missing
    )
    text = top.text_config
    assert (text.topk_method, text.scoring_func, text.moe_layer_freq) == ("noaux_tc", "sigmoid", 1)


def test_the_scan_counts_unguarded_reads_and_skips_guarded_ones():
    source = """
class M:
    def __init__(self, config):
        a = config.plain
        b = getattr(config, "with_default", 0)
        if hasattr(config, "guarded"):
            c = config.guarded
        if hasattr(config, "rope_parameters"):
            d = config.rope_parameters["rope_theta"]
        else:
            d = config.rope_theta
        e = hasattr(config, "q") and config.q is not None
        if isinstance(config, OtherConfig):
            h = config.other_only
        try:
            f = config.tried
        except AttributeError:
            f = None
        self.config = config
        g = self.config.through_self
"""
    reads = config_reads(source, "m.py")
    assert [r.attr for r in reads] == [
        "plain",
        "guarded",
        "rope_parameters",
        "rope_theta",
        "q",
        "other_only",
        "through_self",
    ]

    class WithRope:
        plain = through_self = rope_parameters = 1

    class Bare:
        plain = through_self = 1

    assert missing_reads(reads, {"text": WithRope()}, {"m.py"}) == []
    assert missing_reads(reads, {"text": Bare()}, {"m.py"}) == [
        "m.py:11: text config has no rope_theta"
    ]
    assert missing_reads(reads, {"text": object()}, {"m.py"}) == [
        "m.py:11: text config has no rope_theta",
        "m.py:20: text config has no through_self",
        "m.py:4: text config has no plain",
    ]


def test_the_builder_writes_the_committed_tiny_config():
    """A rebuild of fixtures/tiny-target (eyas/local/tiny_target.py) writes this config.json
    again."""
    from eyas.local import tiny_target as tt

    committed = json.loads((TINY / "config.json").read_text())
    assert tt.hf_config_dict(tt.tiny_config(committed["vocab_size"])) == committed


def test_the_builder_writes_the_committed_cpu_variant_config():
    """fixtures/tiny-target-cpu, the real-SGLang tier's target, is tiny_config's "cpu" variant, at
    the widths SGLang's CPU kernels take: heads and the MLA cache row in multiples of 32, top-8 of
    128 experts of 32, YaRN rope with factor 1 (plain RoPE)."""
    from eyas.local import tiny_target as tt

    committed = json.loads((TINY.parent / "tiny-target-cpu" / "config.json").read_text())
    assert tt.hf_config_dict(tt.tiny_config(committed["vocab_size"], "cpu")) == committed
    c = committed
    assert (c["qk_nope_head_dim"] + c["qk_rope_head_dim"]) % 32 == 0 == c["v_head_dim"] % 32
    assert (c["kv_lora_rank"] + c["qk_rope_head_dim"]) % 32 == 0
    assert (c["n_routed_experts"], c["num_experts_per_tok"], c["moe_intermediate_size"] % 32) == (
        128,
        8,
        0,
    )
    assert c["rope_parameters"]["rope_type"] == "yarn" and c["rope_parameters"]["factor"] == 1.0


def test_transformers_ignores_the_keys_only_sglang_reads():
    """eyas's local server (transformers' DeepseekV3) computes the same with and without them, so
    the fixture's weights and every figure measured on them stay as they were."""
    import torch
    from transformers import DeepseekV3ForCausalLM

    from eyas.local import tiny_target as tt

    config = tt.tiny_config(512)
    bare = config.to_dict()
    for key in ("topk_method", "scoring_func", "moe_layer_freq"):
        bare.pop(key)
    x = torch.randint(0, 512, (1, 24))
    logits = []
    for c in (config, type(config)(**bare)):
        torch.manual_seed(0)
        logits.append(DeepseekV3ForCausalLM(c).eval()(x).logits)
    assert not hasattr(type(config)(**bare), "topk_method")
    assert torch.equal(logits[0], logits[1])
