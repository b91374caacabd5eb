"""The SGLang forward hook, run as SGLang 0.5.23 runs it, on real tensors and real dump files.

SGLang itself cannot run here, so the test takes from the real wheel everything that can run
without a GPU: `hook_manager.py` (which resolves "eyas_sglang_hook:make_hook", calls the factory
and registers the hook), the `ForwardMode` enum and `pack_aux_hidden_states`. The hook module is
the copy the patch stage installed into a fake site-packages. ForwardBatch, LogitsProcessorOutput
and the parallel context are SimpleNamespaces whose attribute names are checked against the
wheel's source, so they cannot drift from SGLang.

The model call paths run the wheel's own code too, compiled from its source: the (patched)
`DeepseekV2ForCausalLM.forward` and `set_eagle3_layers_to_capture`, Kimi-K2.5's wrapper
(`KimiK25ForConditionalGeneration.forward`, its capture switch and `model` alias),
`mm_utils.general_mm_embed_routine` / `prepare_mm_inputs` (which call the language model with
input_ids=None) and the model runner's `configure_aux_hidden_state_capture`. Only the decoder
stack (DeepseekV2Model) and the logits processor are stand-ins.
"""

from __future__ import annotations

import ast
import copy
import fnmatch
import importlib
import importlib.util
import inspect
import json
import shlex
import sys
from contextlib import contextmanager, nullcontext
from enum import IntEnum, auto
from functools import total_ordering
from pathlib import Path
from types import ModuleType, SimpleNamespace

import pytest
import torch
from torch import nn

from eyas.dump import DUMP_DIR_ENV, assemble, read_records
from eyas.evaluation.serving import Chain, serving_launch
from eyas.server.hosts import LocalHost
from eyas.server.launch import SGLANG_HOOK, capture_launch, launch_command, launch_env
from eyas.server.sglang_patch import ensure_patched
from tests.sglang_wheel import DSV2, make_site, sglang_config, wheel_text

H, LAYERS = 8, [2, 4, 5]  # hidden size and capture-before layer ids of the fake target
K = len(LAYERS)

# What the hook reads from SGLang objects; each name is checked against the wheel below.
FORWARD_BATCH_FIELDS = (
    "forward_mode",
    "batch_size",
    "input_ids",
    "positions",
    "rids",
    "seq_lens",
    "seq_lens_cpu",
    "orig_seq_lens",
    "extend_num_tokens",
    "extend_seq_lens",
    "extend_seq_lens_cpu",
    "extend_prefix_lens",
    "extend_prefix_lens_cpu",
    "extend_start_loc",
    # read by mm_utils.prepare_mm_inputs on the multimodal wrapper's path
    "input_embeds",
    "mm_inputs",
    "mm_input_embeds",
    "spec_algorithm",
)
OUTPUT_FIELDS = ("next_token_logits", "hidden_states", "last_hidden_states")
PARALLEL_FIELDS = ("attn_tp_rank", "attn_cp_rank")


# ---------------------------------------------------------------------------------------------
# Pieces of the real wheel
# ---------------------------------------------------------------------------------------------


def _class_node(source: str, name: str) -> ast.ClassDef:
    return next(
        n for n in ast.walk(ast.parse(source)) if isinstance(n, ast.ClassDef) and n.name == name
    )


def _class_fields(source: str, name: str) -> set[str]:
    fields = set()
    for node in _class_node(source, name).body:
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            fields.add(node.target.id)
        elif isinstance(node, ast.Assign):
            fields.update(t.id for t in node.targets if isinstance(t, ast.Name))
    return fields


def _load_wheel_module(wheel: Path, member: str, name: str, tmp: Path):
    path = tmp / Path(member).name
    path.write_text(wheel_text(wheel, member))
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def sgl(sglang_wheel, tmp_path_factory):
    """hook_manager, aux_hidden_states (whole modules) and ForwardMode, from the wheel."""
    tmp = tmp_path_factory.mktemp("wheel-modules")
    fbi = wheel_text(sglang_wheel, "sglang/srt/model_executor/forward_batch_info.py")
    namespace = {
        "IntEnum": IntEnum,
        "auto": auto,
        "total_ordering": total_ordering,
        "__name__": "forward_batch_info",
    }
    exec(
        compile(
            ast.Module(
                [_class_node(fbi, "ForwardMode"), _class_node(fbi, "CaptureHiddenMode")], []
            ),
            "forward_batch_info.py",
            "exec",
        ),
        namespace,
    )
    return SimpleNamespace(
        hook_manager=_load_wheel_module(
            sglang_wheel, "sglang/srt/model_executor/hook_manager.py", "sglang_hook_manager", tmp
        ),
        aux=_load_wheel_module(
            sglang_wheel, "sglang/srt/layers/aux_hidden_states.py", "sglang_aux_hidden_states", tmp
        ),
        ForwardMode=namespace["ForwardMode"],
        CaptureHiddenMode=namespace["CaptureHiddenMode"],
    )


@pytest.fixture(scope="module")
def installed(sglang_wheel, tmp_path_factory):
    """The hook module as the patch stage installs it, imported from that site-packages."""
    root = tmp_path_factory.mktemp("hook-site")
    site = make_site(root, sglang_wheel)
    cfg = sglang_config(root, site)
    ensure_patched(LocalHost(), cfg)
    names = ("eyas_sglang_hook", "eyas_dump")
    for name in names:
        sys.modules.pop(name, None)
    sys.path.insert(0, str(site))
    try:
        module = importlib.import_module("eyas_sglang_hook")
        assert Path(module.__file__).parent == site
        yield SimpleNamespace(mod=module, site=site, cfg=cfg)
    finally:
        sys.path.remove(str(site))
        for name in (*names, "sglang"):
            sys.modules.pop(name, None)


@contextmanager
def sglang_features(**features):
    """SGLang's runtime context (sglang.srt.runtime_context.get_exec().features) holding
    `features`."""
    names = ("sglang", "sglang.srt", "sglang.srt.runtime_context")
    saved = {n: sys.modules.get(n) for n in names}
    context = ModuleType("sglang.srt.runtime_context")
    context.get_exec = lambda: SimpleNamespace(features=SimpleNamespace(**features))
    sys.modules.update(
        {
            "sglang": ModuleType("sglang"),
            "sglang.srt": ModuleType("sglang.srt"),
            "sglang.srt.runtime_context": context,
        }
    )
    try:
        yield
    finally:
        for n, m in saved.items():
            if m is None:
                sys.modules.pop(n, None)
            else:
                sys.modules[n] = m


# ---------------------------------------------------------------------------------------------
# A fake target: the real hook registration path on a module tree with a logits_processor
# ---------------------------------------------------------------------------------------------


def make_model(pack):
    class LogitsProcessor(nn.Module):
        def forward(
            self, input_ids, hidden_states, lm_head, logits_metadata, aux_hidden_states=None
        ):
            return SimpleNamespace(
                next_token_logits=lm_head(hidden_states),
                hidden_states=pack(aux_hidden_states) if aux_hidden_states else None,
                last_hidden_states=hidden_states if aux_hidden_states else None,
            )

    class Target(nn.Module):
        def __init__(self):
            super().__init__()
            self.lm_head = nn.Linear(H, 16, bias=False)
            self.logits_processor = LogitsProcessor()

        def forward(self, input_ids, hidden_states, forward_batch, aux):
            # as DeepseekV2ForCausalLM.forward calls it: all positional
            return self.logits_processor(input_ids, hidden_states, self.lm_head, forward_batch, aux)

    return Target()


class Sequence:
    """One request's prompt and the hidden states the target 'computes' for it."""

    def __init__(self, rid: str, length: int, seed: int):
        g = torch.Generator().manual_seed(seed)
        self.rid = rid
        self.tokens = torch.randint(0, 1000, (length,), generator=g)
        self.aux = [torch.randn(length, H, generator=g) for _ in LAYERS]
        self.last = torch.randn(length, H, generator=g)


def make_batch(mode, rows, pad: int = 0):
    """(forward_batch, last [T, H], aux K x [T, H]) for rows: (Sequence, prefix, n) extend rows,
    or (rid, prefix) decode rows."""
    ids, aux, last, meta = [], [[] for _ in LAYERS], [], []
    for row in rows:
        if isinstance(row[0], Sequence):
            seq, prefix, n = row
            ids.append(seq.tokens[prefix : prefix + n])
            for k in range(K):
                aux[k].append(seq.aux[k][prefix : prefix + n])
            last.append(seq.last[prefix : prefix + n])
            meta.append((seq.rid, prefix, n, len(seq.tokens)))
        else:  # a running request's decode token: its own rows, never to be dumped
            rid, prefix = row
            ids.append(torch.tensor([7]))
            for k in range(K):
                aux[k].append(torch.full((1, H), 1e3))
            last.append(torch.full((1, H), 1e3))
            meta.append((rid, prefix, 1, prefix + 1))
    if pad:  # padding rows past the real tokens (DP / graph padding): NaN, so dumping them fails
        ids.append(torch.zeros(pad, dtype=torch.long))
        for k in range(K):
            aux[k].append(torch.full((pad, H), float("nan")))
        last.append(torch.full((pad, H), float("nan")))
    rids = [m[0] for m in meta]
    prefixes = [m[1] for m in meta]
    lens = [m[2] for m in meta]
    starts = torch.tensor([0] + lens[:-1]).cumsum(0)
    fb = SimpleNamespace(
        input_embeds=None,
        mm_inputs=None,
        mm_input_embeds=None,
        spec_algorithm=None,
        contains_mm_inputs=lambda: False,
        forward_mode=mode,
        batch_size=len(rows),
        input_ids=torch.cat(ids),
        rids=rids,
        positions=torch.cat([torch.arange(p, p + n) for p, n in zip(prefixes, lens)]),
        seq_lens=torch.tensor([p + n for p, n in zip(prefixes, lens)]),
        seq_lens_cpu=torch.tensor([p + n for p, n in zip(prefixes, lens)]),
        orig_seq_lens=torch.tensor([m[3] for m in meta], dtype=torch.int32),
        extend_num_tokens=sum(lens),
        extend_seq_lens=torch.tensor(lens, dtype=torch.int32),
        extend_seq_lens_cpu=lens,
        extend_prefix_lens=torch.tensor(prefixes, dtype=torch.int32),
        extend_prefix_lens_cpu=prefixes,
        extend_start_loc=starts.to(torch.int32),
    )
    return fb, torch.cat(last), [torch.cat(a) for a in aux]


def forward(model, mode, rows, pad: int = 0, capture: bool = True):
    """One forward of the fake target; capture=False is a server without aux capture."""
    fb, last, aux = make_batch(mode, rows, pad)
    return model(fb.input_ids, last, fb, aux if capture else None)


def hook_specs(tmp: Path, dump_dir: Path) -> list[dict]:
    """The --forward-hooks JSON that eyas/server/launch.py emits, plus the keys it should pass."""
    from tests.stage_config import stage_config

    cfg = stage_config(
        tmp, tmp / "ckpt", **{"server.backend": "sglang", "server.dump_dir": str(dump_dir)}
    )
    argv = shlex.split(launch_command(capture_launch(cfg)))
    specs = json.loads(argv[argv.index("--forward-hooks") + 1])
    assert specs[0]["hook_factory"] == SGLANG_HOOK and specs[0]["target_modules"] == [
        "*logits_processor"
    ]
    specs[0]["config"].update(layer_ids=LAYERS, dtype="float32")
    return specs


# ---------------------------------------------------------------------------------------------
# The fakes cannot drift from the wheel
# ---------------------------------------------------------------------------------------------


def test_fakes_use_only_names_the_wheel_defines(sglang_wheel):
    src = lambda member: wheel_text(sglang_wheel, f"sglang/srt/{member}")  # noqa: E731
    fbi = src("model_executor/forward_batch_info.py")
    assert set(FORWARD_BATCH_FIELDS) <= _class_fields(fbi, "ForwardBatch")
    assert any(
        isinstance(n, ast.FunctionDef) and n.name == "contains_mm_inputs"
        for n in _class_node(fbi, "ForwardBatch").body
    )
    assert "rids=[req.rid for req in batch.reqs]" in fbi
    assert set(OUTPUT_FIELDS) <= _class_fields(
        src("layers/logits_processor.py"), "LogitsProcessorOutput"
    )
    assert set(PARALLEL_FIELDS) <= _class_fields(src("arg_groups/fields/parallel.py"), "Parallel")
    assert "def get_parallel() -> ParallelContext:" in src("runtime_context.py")
    assert "def get_exec() -> _ConfigBag:" in src("runtime_context.py")
    features = src("model_executor/model_runner_components/spec_aux_hidden_state.py")
    assert "features = get_exec().features" in features
    assert "features.return_aux_hidden_state_layer_ids" in features
    assert {"aux_hidden_state_capture", "return_aux_hidden_state_layer_ids"} <= _class_fields(
        src("arg_groups/fields/exec_.py"), "ExecFeatures"
    )
    # the hook sees only positional args: the model must call the logits processor positionally
    assert (
        "self.logits_processor(\n                input_ids, hidden_states, self.lm_head, "
        "forward_batch, aux_hidden_states\n            )"
    ) in src("models/deepseek_v2.py")
    forward = next(
        n
        for n in _class_node(src("layers/logits_processor.py"), "LogitsProcessor").body
        if isinstance(n, ast.FunctionDef) and n.name == "forward"
    )
    assert [a.arg for a in forward.args.args[:6]] == [
        "self",
        "input_ids",
        "hidden_states",
        "lm_head",
        "logits_metadata",
        "aux_hidden_states",
    ]


def test_factory_matches_how_hook_manager_calls_it(sglang_wheel, sgl, installed):
    tree = ast.parse(wheel_text(sglang_wheel, "sglang/srt/model_executor/hook_manager.py"))
    calls = [n for n in ast.walk(tree) if isinstance(n, ast.Call)]
    [factory_call] = [
        c for c in calls if isinstance(c.func, ast.Name) and c.func.id == "hook_factory"
    ]
    assert [ast.unparse(a) for a in factory_call.args] == ["config"] and not factory_call.keywords
    [register] = [
        c
        for c in calls
        if isinstance(c.func, ast.Attribute) and c.func.attr == "register_forward_hook"
    ]
    assert len(register.args) == 1 and not register.keywords  # so: hook(module, args, output)

    make_hook = sgl.hook_manager.resolve_callable(SGLANG_HOOK)  # the real resolver, real import
    assert make_hook is installed.mod.make_hook
    sig = inspect.signature(make_hook)
    sig.bind({"dump_dir": "/x"})
    assert all(
        p.kind is p.KEYWORD_ONLY and p.default is not p.empty
        for p in list(sig.parameters.values())[1:]
    )
    hook = make_hook({"dump_dir": "/x", "layer_ids": LAYERS, "max_pending": 0})
    inspect.signature(hook).bind(nn.Identity(), (), None)


# ---------------------------------------------------------------------------------------------
# Dumping
# ---------------------------------------------------------------------------------------------


def test_hook_dumps_every_prefill_chunk_and_nothing_else(tmp_path, sgl, installed):
    model = make_model(sgl.aux.pack_aux_hidden_states)
    dump_dir = tmp_path / "dump"
    sgl.hook_manager.register_forward_hooks(model, hook_specs(tmp_path, dump_dir))
    [hook] = model.logits_processor._forward_hooks.values()
    Mode = sgl.ForwardMode
    a, b = Sequence("eyas-a-0", 9, seed=1), Sequence("eyas-b-0", 4, seed=2)
    warmup = Sequence("1f0e6c2b9a7d4e0f8c3b2a1d0e9f8c7b", 5, seed=3)  # SGLang's warmup: a uuid
    health = Sequence("HEALTH_CHECK_3b2a1d0e", 1, seed=4)

    # 1. EXTEND: a's first chunk, all of b, server traffic; padding rows at the end
    forward(model, Mode.EXTEND, [(a, 0, 3), (b, 0, 4), (warmup, 0, 5), (health, 0, 1)], pad=3)
    # 2. MIXED: a's middle chunk (prefix offset 3) and b's first decode token
    forward(model, Mode.MIXED, [(a, 3, 3), ("eyas-b-0", 4)])
    # 3. DECODE and IDLE forwards hold no prefill rows
    forward(model, Mode.DECODE, [("eyas-b-0", 5)])
    # 4. EXTEND: a's last chunk, next to a decode of b turned into a 1-token extend (DP attention)
    forward(model, Mode.EXTEND, [("eyas-b-0", 6), (a, 6, 3)])
    hook.flush()

    assert sorted(p.name for p in dump_dir.iterdir()) == ["eyas-a-0", "eyas-b-0"]
    for seq, offsets in ((a, [0, 3, 6]), (b, [0])):
        records = read_records(dump_dir, seq.rid)
        assert [r.prefix_offset for r in records] == offsets
        sample = assemble(records, seq.tokens.tolist())
        assert torch.equal(sample.token_ids, seq.tokens.to(torch.int32))
        assert torch.equal(sample.aux_hidden_states, torch.cat(seq.aux, dim=-1))
        assert torch.equal(sample.last_hidden_state, seq.last)
        assert (
            sample.meta["layer_ids"] == LAYERS
            and sample.meta["layer_convention"] == "capture-before"
        )
        assert sample.meta["last_hidden_norm"] == "post" and sample.meta["dtype"] == "float32"

    # a rid sent again (a new prefill starts at 0) is dumped again, despite its finished prefill
    forward(model, Mode.EXTEND, [(b, 0, 4)])
    hook.flush()
    assert assemble(read_records(dump_dir, b.rid), b.tokens.tolist()).meta["num_chunks"] == 1


@pytest.mark.parametrize("ranks, writes", [((0, 0), True), ((1, 0), False), ((0, 1), False)])
def test_only_attention_tp_rank_0_writes(tmp_path, sgl, installed, ranks, writes):
    model = make_model(sgl.aux.pack_aux_hidden_states)
    parallel = SimpleNamespace(**dict(zip(PARALLEL_FIELDS, ranks)))
    hook = installed.mod.make_hook(
        {"dump_dir": str(tmp_path / "dump"), "layer_ids": LAYERS, "max_pending": 0},
        parallel=parallel,
    )
    model.logits_processor.register_forward_hook(hook)
    seq = Sequence("eyas-r", 4, seed=5)
    forward(model, sgl.ForwardMode.EXTEND, [(seq, 0, 4)])
    assert (len(read_records(tmp_path / "dump", seq.rid)) == 1) is writes


def test_layer_ids_follow_deepseek_v2s_rule(sglang_wheel, installed):
    source = wheel_text(sglang_wheel, DSV2)
    assert "if layer_ids and layer_ids[0] == 1:" in source
    assert "self.model.layers_to_capture = [val + 1 for val in layer_ids]" in source
    resolve = installed.mod.resolve_layer_ids
    assert resolve(None, [1, 29, 57]) == [2, 30, 58]  # "output-of" ids, shifted by SGLang
    assert resolve(None, [2, 30, 58]) == [2, 30, 58]
    assert resolve([2, 30, 58], [1, 29, 57]) == [2, 30, 58]
    assert resolve([3, 31, 59], None) == [3, 31, 59]
    with pytest.raises(installed.mod.HookError, match=r"captures \[2, 30, 58\]"):
        resolve([1, 29, 57], [1, 29, 57])
    with pytest.raises(installed.mod.HookError, match="no layer ids"):
        resolve(None, None)


def test_layer_ids_follow_llamas_rule_and_the_launch_asks_for_them(
    sglang_wheel, installed, tmp_path
):
    """LlamaForCausalLM shifts every id by +1: the launch asks for capture - 1, the hook checks
    it."""
    llama = _class_node(wheel_text(sglang_wheel, "sglang/srt/models/llama.py"), "LlamaForCausalLM")
    setter = ast.unparse(
        next(n for n in llama.body if getattr(n, "name", "") == "set_eagle3_layers_to_capture")
    )
    assert "self.model.layers_to_capture = [val + 1 for val in layer_ids]" in setter
    assert "layer_ids[0] == 1" not in setter
    resolve, llama_arch = installed.mod.resolve_layer_ids, "LlamaForCausalLM"
    assert resolve([2, 4, 5], [1, 3, 4], llama_arch) == [2, 4, 5]
    with pytest.raises(installed.mod.HookError, match=r"LlamaForCausalLM captures \[3, 5, 6\]"):
        resolve(
            [2, 4, 5], [2, 4, 5], llama_arch
        )  # DeepSeek's ids on a Llama: silently wrong layers
    from tests.stage_config import stage_config

    cfg = stage_config(tmp_path, tmp_path / "ckpt", **{"server.backend": "sglang"})
    for arch, asked in (
        (llama_arch, "1 3 4"),
        ("KimiK25ForConditionalGeneration", "2 4 5"),
        (None, "2 4 5"),
    ):
        argv = shlex.split(launch_command(capture_launch(cfg), arch))
        i = argv.index("--return-aux-hidden-state-layer-ids")
        assert " ".join(argv[i + 1 : i + 4]) == asked
        config = json.loads(argv[argv.index("--forward-hooks") + 1])[0]["config"]
        assert (
            config["layer_ids"] == cfg.target.capture_ids() and config.get("architecture") == arch
        )


def test_misconfiguration_fails_loudly(tmp_path, sgl, installed):
    mod, Mode = installed.mod, sgl.ForwardMode
    with pytest.raises(mod.HookError, match="unknown config keys"):
        mod.make_hook({"dump_dir": "/x", "layer_ids": LAYERS, "dumpdir": "/y"})
    with pytest.raises(mod.HookError, match="no dump_dir"):
        mod.make_hook({"layer_ids": LAYERS})
    # registered through --forward-hooks in a server without capture-only mode: refused at start
    with sglang_features(aux_hidden_state_capture=None, return_aux_hidden_state_layer_ids=None):
        with pytest.raises(mod.HookError, match="--enable-return-aux-hidden-states"):
            mod.make_hook({"dump_dir": str(tmp_path), "layer_ids": LAYERS})
    # a forward without aux and last states (no capture) dumps nothing and does not fail
    model = make_model(sgl.aux.pack_aux_hidden_states)
    model.logits_processor.register_forward_hook(
        mod.make_hook({"dump_dir": str(tmp_path), "layer_ids": LAYERS, "max_pending": 0})
    )
    warmup = Sequence("0d9e8f7a6b5c4d3e2f1a0b9c8d7e6f5a", 4, seed=6)
    forward(
        model, Mode.EXTEND, [(warmup, 0, 4), (Sequence("eyas-n", 3, seed=5), 0, 3)], capture=False
    )
    warmup = Sequence("eyas-w", 4, seed=6)
    # fewer captured layers than the hook was told
    model = make_model(sgl.aux.pack_aux_hidden_states)
    model.logits_processor.register_forward_hook(
        mod.make_hook({"dump_dir": str(tmp_path), "layer_ids": [*LAYERS, 6], "max_pending": 0})
    )
    with pytest.raises(mod.HookError, match="expected 4 layers x 8"):
        forward(model, Mode.EXTEND, [(warmup, 0, 4)])
    assert not any(tmp_path.iterdir())


def test_a_failed_write_stops_the_server_at_the_next_forward(tmp_path, sgl, installed):
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("")
    model = make_model(sgl.aux.pack_aux_hidden_states)
    hook = installed.mod.make_hook({"dump_dir": str(blocker), "layer_ids": LAYERS})
    model.logits_processor.register_forward_hook(hook)
    forward(model, sgl.ForwardMode.EXTEND, [(Sequence("eyas-f", 3, seed=7), 0, 3)])
    with pytest.raises(installed.mod.HookError, match="dump writer failed"):
        hook.flush()
    with pytest.raises(installed.mod.HookError, match="dump writer failed"):
        forward(model, sgl.ForwardMode.EXTEND, [(Sequence("eyas-g", 3, seed=8), 0, 3)])


def test_patched_deepseek_v2_writes_through_the_same_hook(tmp_path, sgl, installed):
    """The source patch's helper, run from the patched file, with and without a registered hook."""
    patched = (installed.site / DSV2).read_text()
    assert (
        "if _EYAS_DUMP_DIR and aux_hidden_states is not None and logits_output.last_hidden_states "
        "is not None:"
    ) in patched
    helper = next(
        n
        for n in ast.parse(patched).body
        if isinstance(n, ast.FunctionDef) and n.name == "_eyas_dump"
    )
    ns = {"_EYAS_DUMP_DIR": str(tmp_path / "dump"), "_eyas_dump_hook": None}
    exec(compile(ast.Module([helper], []), str(installed.site / DSV2), "exec"), ns)

    model = make_model(sgl.aux.pack_aux_hidden_states)
    target = SimpleNamespace(
        model=SimpleNamespace(layers_to_capture=LAYERS),
        lm_head=model.lm_head,
        logits_processor=model.logits_processor,
    )
    seq, again = Sequence("eyas-p", 5, seed=9), Sequence("eyas-q", 5, seed=10)

    def prefill(
        s,
    ):  # what the patched DeepseekV2ForCausalLM.forward does after the logits processor
        fb, last, aux = make_batch(sgl.ForwardMode.EXTEND, [(s, 0, 5)])
        out = model.logits_processor(fb.input_ids, last, model.lm_head, fb, aux)
        ns["_eyas_dump"](target, fb.input_ids, last, fb, aux, out)

    installed.mod._forward_hook_active = False
    prefill(seq)
    ns["_eyas_dump_hook"].flush()
    sample = assemble(read_records(tmp_path / "dump", seq.rid), seq.tokens.tolist())
    assert sample.meta["layer_ids"] == LAYERS and sample.meta["dtype"] == "bfloat16"
    assert torch.equal(sample.last_hidden_state, seq.last.to(torch.bfloat16))

    installed.mod._forward_hook_active = True  # a --forward-hooks hook already writes
    prefill(again)
    ns["_eyas_dump_hook"].flush()
    assert read_records(tmp_path / "dump", again.rid) == []
    installed.mod._forward_hook_active = False


# ---------------------------------------------------------------------------------------------
# SGLang's own call paths: the DeepseekV3 text model, and Kimi-K2.5's multimodal wrapper
# ---------------------------------------------------------------------------------------------

VOCAB = 1000
KIMI = "KimiK25ForConditionalGeneration"
DSV2_METHODS = ("forward", "set_eagle3_layers_to_capture", "get_input_embeddings")
KIMI_METHODS = (
    "forward",
    "set_eagle3_layers_to_capture",
    "get_input_embeddings",
    "get_image_feature",
    "model",
    "lm_head",
    "__setattr__",
)
# what each wheel __init__ sets that the wheel methods above use; the stand-in __init__s set the
# same
DSV2_INIT_ATTRS = {
    "pp_group",
    "config",
    "model",
    "lm_head",
    "logits_processor",
    "capture_aux_hidden_states",
}
KIMI_INIT_ATTRS = {"vision_tower", "mm_projector", "language_model"}


def _exec_wheel_nodes(nodes: list[ast.stmt], namespace: dict, filename: str) -> dict:
    module = ast.Module([ast.ImportFrom("__future__", [ast.alias("annotations")], 0), *nodes], [])
    exec(compile(ast.fix_missing_locations(module), filename, "exec"), namespace)  # noqa: S102 - the wheel's own code
    return namespace


def _wheel_function(source: str, name: str) -> ast.FunctionDef:
    return next(
        n for n in ast.parse(source).body if isinstance(n, ast.FunctionDef) and n.name == name
    )


def _wheel_class(source: str, name: str, methods, namespace: dict, filename: str) -> type:
    """The wheel's class with only `methods` (its code and decorators), as an nn.Module."""
    node = copy.deepcopy(_class_node(source, name))
    node.body = [n for n in node.body if isinstance(n, ast.FunctionDef) and n.name in methods]
    assert {n.name for n in node.body} == set(methods), f"{name} no longer defines all of {methods}"
    node.bases = [ast.Attribute(ast.Name("nn", ast.Load()), "Module", ast.Load())]
    node.keywords, node.decorator_list = [], []
    return _exec_wheel_nodes([node], namespace, filename)[name]


def _init_attrs(source: str, name: str) -> set[str]:
    init = next(
        n
        for n in _class_node(source, name).body
        if isinstance(n, ast.FunctionDef) and n.name == "__init__"
    )
    return {
        t.attr
        for n in ast.walk(init)
        if isinstance(n, ast.Assign)
        for t in n.targets
        if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self"
    }


class DecoderStack(nn.Module):
    """Stands in for DeepseekV2Model: returns the hidden states the test planned for the forward,
    and the aux capture once layers_to_capture is set (DeepseekV2Model returns a tuple only
    then)."""

    def __init__(self):
        super().__init__()
        self.embed_tokens = nn.Embedding(VOCAB, H)
        self.layers_to_capture: list[int] = []
        self.planned = None
        self.calls = []  # (input_ids, input_embeds) of each forward

    def forward(
        self, input_ids, positions, forward_batch, input_embeds=None, pp_proxy_tensors=None
    ):
        self.calls.append((input_ids, input_embeds))
        last, aux = self.planned
        return (last, aux) if self.layers_to_capture else last


@pytest.fixture(scope="module")
def wheel_code(sglang_wheel, installed):
    """Sources of the wheel's call path (deepseek_v2.py as the patch stage left it) and its
    checks."""

    def src(member: str) -> str:
        return wheel_text(sglang_wheel, f"sglang/srt/{member}")

    code = SimpleNamespace(
        dsv2=(installed.site / DSV2).read_text(),
        kimi=src("models/kimi_k25.py"),
        mm=src("managers/mm_utils.py"),
        aux_setup=src("model_executor/model_runner_components/attention_backend_setup.py"),
        eager=src("model_executor/runner/eager_runner.py"),
    )
    assert DSV2_INIT_ATTRS <= _init_attrs(code.dsv2, "DeepseekV2ForCausalLM")
    assert KIMI_INIT_ATTRS <= _init_attrs(code.kimi, KIMI)
    assert "self.language_model = DeepseekV3ForCausalLM(" in code.kimi
    stack = next(
        n
        for n in _class_node(code.dsv2, "DeepseekV2Model").body
        if isinstance(n, ast.FunctionDef) and n.name == "forward"
    )
    assert [a.arg for a in stack.args.args] == [
        "self",
        "input_ids",
        "positions",
        "forward_batch",
        "input_embeds",
        "pp_proxy_tensors",
    ]
    # EagerRunner._execute_extend calls the top-level model like this (as `call` below does)
    assert (
        "model_runner.model.forward( forward_batch.input_ids, forward_batch.positions, "
        "forward_batch, **kwargs, )"
    ) in " ".join(code.eager.split())
    return code


def build_target(
    code, installed, logits_processor, *, wrapped: bool, dump_env: Path | None, embed_mm_inputs=None
):
    """(top-level model, language model, namespace of the patched deepseek_v2 code)."""
    dsv2_file = str(installed.site / DSV2)
    ns = {
        "torch": torch,
        "nn": nn,
        "_EYAS_DUMP_DIR": str(dump_env) if dump_env else None,
        "_eyas_dump_hook": None,
        "get_attn_tp_context": lambda: SimpleNamespace(
            maybe_input_scattered=lambda fb: nullcontext()
        ),
    }
    _exec_wheel_nodes([_wheel_function(code.dsv2, "_eyas_dump")], ns, dsv2_file)

    class LanguageModel(
        _wheel_class(code.dsv2, "DeepseekV2ForCausalLM", DSV2_METHODS, ns, dsv2_file)
    ):
        def __init__(self):
            nn.Module.__init__(self)
            self.pp_group = SimpleNamespace(is_first_rank=True, is_last_rank=True, world_size=1)
            self.config = SimpleNamespace(num_hidden_layers=8)
            self.model = DecoderStack()
            self.lm_head = nn.Linear(H, 16, bias=False)
            self.logits_processor = logits_processor
            self.capture_aux_hidden_states = False

    lm = LanguageModel()
    if not wrapped:
        return lm, lm, ns
    mm_ns = {
        "torch": torch,
        "nn": nn,
        "get_server_args": lambda: None,
        "embed_mm_inputs": embed_mm_inputs or (lambda **kw: pytest.fail("multimodal path taken")),
    }
    _exec_wheel_nodes(
        [_wheel_function(code.mm, f) for f in ("prepare_mm_inputs", "general_mm_embed_routine")],
        mm_ns,
        "mm_utils.py",
    )
    kimi_ns = {
        "torch": torch,
        "nn": nn,
        "general_mm_embed_routine": mm_ns["general_mm_embed_routine"],
        "Modality": SimpleNamespace(IMAGE="image"),
    }

    class Kimi(_wheel_class(code.kimi, KIMI, KIMI_METHODS, kimi_ns, "kimi_k25.py")):
        def __init__(self, language_model):
            nn.Module.__init__(self)
            self.vision_tower = nn.Linear(2, 2)
            self.mm_projector = nn.Linear(2, 2)
            self.language_model = language_model

    return Kimi(lm), lm, ns


def call(top, lm, mode, rows, pad: int = 0, fb_changes: dict | None = None):
    """One forward, as EagerRunner._execute_extend makes it: model.forward(ids, positions,
    batch)."""
    fb, last, aux = make_batch(mode, rows, pad)
    for key, value in (fb_changes or {}).items():
        setattr(fb, key, value)
    lm.model.planned = (last, aux)
    top.forward(fb.input_ids, fb.positions, fb)
    return fb


def configure_capture(code, top):
    """The model runner's init_attention_backends: the wheel's
    configure_aux_hidden_state_capture."""
    ns = _exec_wheel_nodes(
        [_wheel_function(code.aux_setup, "configure_aux_hidden_state_capture")],
        {},
        "attention_backend_setup.py",
    )
    ns["configure_aux_hidden_state_capture"](
        model=top,
        eagle_use_aux_hidden_state=True,
        eagle_aux_hidden_state_layer_ids=LAYERS,
        dflash_use_aux_hidden_state=False,
        dflash_target_layer_ids=None,
        is_dspark=False,
    )


@pytest.mark.parametrize("via", ["forward_hooks", "source_patch"])
@pytest.mark.parametrize("wrapped", [False, True], ids=["deepseek-v3-text", "kimi-k2.5-wrapper"])
def test_sglang_call_paths_dump_the_right_ids_in_every_chunk(
    tmp_path, sgl, installed, wheel_code, wrapped, via
):
    dump_dir = tmp_path / "dump"
    logits_processor = make_model(sgl.aux.pack_aux_hidden_states).logits_processor
    # the capture launch sets EYAS_DUMP_DIR; with --forward-hooks the patched file stands back
    top, lm, ns = build_target(
        wheel_code, installed, logits_processor, wrapped=wrapped, dump_env=dump_dir
    )
    installed.mod._forward_hook_active = False

    configure_capture(wheel_code, top)  # through the wrapper's set_eagle3_layers_to_capture
    assert lm.capture_aux_hidden_states and lm.model.layers_to_capture == LAYERS
    names = [n for n, _ in top.named_modules() if fnmatch.fnmatch(n, "*logits_processor")]
    assert names == (["language_model.logits_processor"] if wrapped else ["logits_processor"])
    if via == "forward_hooks":
        sgl.hook_manager.register_forward_hooks(top, hook_specs(tmp_path, dump_dir))
        [hook] = lm.logits_processor._forward_hooks.values()
    Mode = sgl.ForwardMode
    a, b = Sequence("eyas-a-0", 9, seed=11), Sequence("eyas-b-0", 4, seed=12)
    warmup = Sequence("1f0e6c2b9a7d4e0f8c3b2a1d0e9f8c7b", 5, seed=13)
    try:
        # chunked prefill of a (3 chunks of 3), b whole, a decode of b in MIXED and in EXTEND
        batches = [
            call(top, lm, Mode.EXTEND, [(a, 0, 3), (b, 0, 4), (warmup, 0, 5)], pad=3),
            call(top, lm, Mode.MIXED, [(a, 3, 3), ("eyas-b-0", 4)]),
            call(top, lm, Mode.DECODE, [("eyas-b-0", 5)]),
            call(top, lm, Mode.EXTEND, [("eyas-b-0", 6), (a, 6, 3)]),
        ]
        for fb, (ids, embeds) in zip(batches, lm.model.calls, strict=True):
            if wrapped:  # general_mm_embed_routine: ids None, the embeddings of the batch's ids
                assert ids is None and torch.equal(embeds, lm.model.embed_tokens(fb.input_ids))
            else:
                assert ids is fb.input_ids and embeds is None
        if via == "forward_hooks":
            hook.flush()
            assert ns["_eyas_dump_hook"] is None  # the patched file never wrote a second copy
        else:
            ns["_eyas_dump_hook"].flush()
    finally:
        installed.mod._forward_hook_active = False

    assert sorted(p.name for p in dump_dir.iterdir()) == ["eyas-a-0", "eyas-b-0"]
    for seq, offsets in ((a, [0, 3, 6]), (b, [0])):
        records = read_records(dump_dir, seq.rid)
        assert [r.prefix_offset for r in records] == offsets
        sample = assemble(records, seq.tokens.tolist())
        dtype = sample.aux_hidden_states.dtype
        assert torch.equal(sample.token_ids, seq.tokens.to(torch.int32))
        assert torch.equal(sample.aux_hidden_states, torch.cat(seq.aux, dim=-1).to(dtype))
        assert torch.equal(sample.last_hidden_state, seq.last.to(dtype))
        assert sample.meta["layer_ids"] == LAYERS


def test_a_forward_with_multimodal_inputs_is_not_dumped(
    tmp_path, sgl, installed, wheel_code, caplog
):
    """On the wrapper's image path mm_utils overwrites the batch's ids (pad values, clamped in
    place): such a forward is logged and skipped, never dumped with wrong ids."""
    assert "input_ids.clamp_(min=0, max=vocab_size - 1)" in wheel_code.mm
    assert "forward_batch.mm_input_embeds = (" in wheel_code.mm

    def embed_mm_inputs(*, input_ids, input_embedding, **_):  # what the wheel's does to the ids
        input_ids.clamp_(min=0, max=input_embedding.num_embeddings - 1)
        return input_embedding(input_ids), {}

    dump_dir = tmp_path / "dump"
    logits_processor = make_model(sgl.aux.pack_aux_hidden_states).logits_processor
    top, lm, _ = build_target(
        wheel_code,
        installed,
        logits_processor,
        wrapped=True,
        dump_env=None,
        embed_mm_inputs=embed_mm_inputs,
    )
    configure_capture(wheel_code, top)
    sgl.hook_manager.register_forward_hooks(top, hook_specs(tmp_path, dump_dir))
    [hook] = lm.logits_processor._forward_hooks.values()
    image, text = Sequence("eyas-img", 4, seed=14), Sequence("eyas-txt", 3, seed=15)
    image.tokens[1] = 10**9  # an image pad value (a hash), as pad_input_ids leaves it
    try:
        fb = call(
            top,
            lm,
            sgl.ForwardMode.EXTEND,
            [(image, 0, 4), (text, 0, 3)],
            fb_changes={
                "contains_mm_inputs": lambda: True,
                "mm_inputs": [SimpleNamespace(mm_items=[]), None],
            },
        )
        hook.flush()
    finally:
        installed.mod._forward_hook_active = False
    assert fb.mm_input_embeds is not None and int(fb.input_ids[1]) == VOCAB - 1
    assert not dump_dir.exists() or not any(dump_dir.iterdir())
    assert "carried multimodal inputs" in caplog.text and "eyas-img" in caplog.text


# ---------------------------------------------------------------------------------------------
# A speculative serving launch: the target captures aux states for its draft, keeps no last states
# ---------------------------------------------------------------------------------------------

LP_METHODS = ("_get_hidden_states_to_store", "_get_last_hidden_states_to_store")


def wheel_logits_processor(sglang_wheel, sgl, *, capture_only: bool) -> nn.Module:
    """A logits processor whose stored states come from the wheel's own LogitsProcessor methods,
    with keep_last_hidden_states set by the wheel's rule (capture-only mode, i.e.
    --enable-return-aux-hidden-states, sets features.aux_hidden_state_capture)."""
    source = wheel_text(sglang_wheel, "sglang/srt/layers/logits_processor.py")
    assert "self.keep_last_hidden_states = features.aux_hidden_state_capture is not None" in source
    ns = {"torch": torch, "nn": nn, "pack_aux_hidden_states": sgl.aux.pack_aux_hidden_states}
    base = _wheel_class(source, "LogitsProcessor", LP_METHODS, ns, "logits_processor.py")

    class LogitsProcessor(base):
        def __init__(self):
            nn.Module.__init__(self)
            self.keep_last_hidden_states = capture_only

        def forward(
            self, input_ids, hidden_states, lm_head, logits_metadata, aux_hidden_states=None
        ):
            # the whole extend is "pruned" (no sample_indices): as LogitsProcessor.forward passes
            # them
            stored = self._get_hidden_states_to_store(
                hidden_states,
                None,
                aux_hidden_states,
                hidden_states,
                None,
                aux_hidden_states,
                None,
                logits_metadata,
            )
            last = self._get_last_hidden_states_to_store(
                hidden_states, aux_hidden_states, logits_metadata
            )
            return SimpleNamespace(
                next_token_logits=lm_head(hidden_states),
                hidden_states=stored,
                last_hidden_states=last,
            )

    return LogitsProcessor()


@pytest.mark.parametrize("dump_env", ["as launched", "forced"])
@pytest.mark.parametrize("wrapped", [False, True], ids=["deepseek-v3-text", "kimi-k2.5-wrapper"])
def test_a_speculative_serving_launch_runs_the_patched_file_and_hook_and_dumps_nothing(
    tmp_path, sglang_wheel, sgl, installed, wheel_code, wrapped, dump_env, caplog
):
    """The serving benchmark's EAGLE3 launch on a source-patched SGLang: its first prefill (SGLang's
    warm-up) and every later one pass through the patched DeepseekV2ForCausalLM.forward and the hook
    without failing and without writing, whether or not EYAS_DUMP_DIR reaches the server."""
    cfg = installed.cfg
    spec = serving_launch(cfg, Chain.of(3).label, tmp_path / "drafter", chain=Chain.of(3))
    env, argv = launch_env(spec), shlex.split(launch_command(spec))
    assert "--speculative-draft-model-path" in argv and "--forward-hooks" not in argv
    assert "--enable-return-aux-hidden-states" not in argv and DUMP_DIR_ENV not in env
    capture_env = launch_env(
        capture_launch(cfg)
    )  # the extraction launch of the same config does get it
    assert capture_env[DUMP_DIR_ENV] == str(cfg.server.dump_dir)
    dump_dir = tmp_path / "dump" if dump_env == "forced" else env.get(DUMP_DIR_ENV)

    top, lm, ns = build_target(
        wheel_code,
        installed,
        wheel_logits_processor(sglang_wheel, sgl, capture_only=False),
        wrapped=wrapped,
        dump_env=dump_dir,
    )
    configure_capture(
        wheel_code, top
    )  # the EAGLE3 worker: the target captures aux states for its draft
    installed.mod._forward_hook_active = False
    warmup, request = (
        Sequence("8c1d0f2e3b4a59687a6b5c4d3e2f1a0b", 5, seed=21),
        Sequence("eyas-s-0", 6, seed=22),
    )
    full = {"capture_hidden_mode": sgl.CaptureHiddenMode.FULL}  # a target extend in EAGLE3 mode
    call(top, lm, sgl.ForwardMode.EXTEND, [(warmup, 0, 5)], fb_changes=full)
    call(top, lm, sgl.ForwardMode.EXTEND, [(request, 0, 6)], fb_changes=full)
    assert lm.capture_aux_hidden_states  # aux states were there; only the last states were not
    if dump_env == "forced":
        assert ns["_eyas_dump_hook"] is None  # the patched file's guard stopped before the hook
        assert not dump_dir.exists() or not any(dump_dir.iterdir())


def test_the_wheel_logits_processor_keeps_last_states_in_capture_only_mode(
    tmp_path, sglang_wheel, sgl, installed, wheel_code
):
    """The same stand-in with capture-only mode on (a capture launch) dumps through the patched
    file."""
    dump_dir = tmp_path / "dump"
    top, lm, ns = build_target(
        wheel_code,
        installed,
        wheel_logits_processor(sglang_wheel, sgl, capture_only=True),
        wrapped=False,
        dump_env=dump_dir,
    )
    configure_capture(wheel_code, top)
    installed.mod._forward_hook_active = False
    seq = Sequence("eyas-c-0", 6, seed=23)
    call(
        top,
        lm,
        sgl.ForwardMode.EXTEND,
        [(seq, 0, 6)],
        fb_changes={"capture_hidden_mode": sgl.CaptureHiddenMode.FULL},
    )
    ns["_eyas_dump_hook"].flush()
    sample = assemble(read_records(dump_dir, seq.rid), seq.tokens.tolist())
    assert torch.equal(
        sample.aux_hidden_states, torch.cat(seq.aux, dim=-1).to(sample.aux_hidden_states.dtype)
    )


# ---------------------------------------------------------------------------------------------
# SGLang's python has no eyas: the installed pair imports without it
# ---------------------------------------------------------------------------------------------


def test_the_installed_hook_and_dump_writer_import_in_a_python_without_eyas(tmp_path):
    """The patch stage's modules, byte for byte, imported and used where `import eyas` fails."""
    import subprocess

    from eyas.server.patch_sets import available_versions, load_patch_set
    from tests.without_eyas import without_eyas

    env = {"PATH": "/usr/bin:/bin"}
    for version in available_versions():
        site = tmp_path / version
        site.mkdir()
        for name, data in load_patch_set(version).modules.items():
            (site / name).write_bytes(data)
        script = (
            "import sys\ntry:\n    import eyas\nexcept ModuleNotFoundError:\n    pass\n"
            "else:\n    sys.exit('eyas is importable: the check proves nothing')\n"
            "import eyas_sglang_hook as h, torch\n"
            "config = {'dump_dir': sys.argv[1], 'layer_ids': [2, 4, 5], 'max_pending': 0}\n"
            "hook = h.make_hook(config)\n"
            "hook.writer.write('eyas-0', 0, torch.arange(3, dtype=torch.int32), "
            "torch.zeros(3, 12), torch.zeros(3, 4))\n"
            "print(sorted(n for n in sys.modules if n.split('.')[0] not in "
            "sys.stdlib_module_names))\n"
        )
        r = subprocess.run(
            [sys.executable, "-c", script, str(tmp_path / "dump" / version)],
            cwd=tmp_path,
            env={**env, "PYTHONPATH": f"{without_eyas(tmp_path)}:{site}"},
            capture_output=True,
            text=True,
            timeout=300,
            check=False,
        )
        assert r.returncode == 0, f"{version}: {r.stderr[-2000:]}"
        top = {n.split(".")[0] for n in ast.literal_eval(r.stdout.strip().splitlines()[-1])}
        assert (
            "eyas" not in top and {"eyas_sglang_hook", "eyas_dump", "torch", "safetensors"} <= top
        )
        assert read_records(tmp_path / "dump" / version, "eyas-0")[0].token_ids.tolist() == [
            0,
            1,
            2,
        ]
