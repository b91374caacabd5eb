"""The SGLang forward hook, run as SGLang 0.5.23 runs it, on real tensors and real dump files.

SGLang itself cannot run here, so the test takes from the real wheel everything that can run
without a GPU: `hook_manager.py` (which resolves "eyas_sglang_hook:make_hook", calls the factory
and registers the hook), the `ForwardMode` enum and `pack_aux_hidden_states`. The hook module is
the copy the patch stage installed into a fake site-packages. ForwardBatch, LogitsProcessorOutput
and the parallel context are SimpleNamespaces whose attribute names are checked against the
wheel's source, so they cannot drift from SGLang.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import inspect
import json
import shlex
import sys
from enum import IntEnum, auto
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from eyas.dump import assemble, read_records
from eyas.server.hosts import LocalHost
from eyas.server.launch import SGLANG_HOOK, launch_command
from eyas.server.sglang_patch import ensure_patched
from tests.integration.test_sglang_patch import DSV2, make_site, sglang_config, sglang_wheel, wheel_text  # noqa: F401

H, LAYERS = 8, [2, 4, 5]  # hidden size and capture-before layer ids of the fake target
K = len(LAYERS)

# What the hook reads from SGLang objects; each name is checked against the wheel below.
FORWARD_BATCH_FIELDS = ("forward_mode", "batch_size", "input_ids", "positions", "rids", "seq_lens",
                        "seq_lens_cpu", "orig_seq_lens", "extend_num_tokens", "extend_seq_lens",
                        "extend_seq_lens_cpu", "extend_prefix_lens", "extend_prefix_lens_cpu",
                        "extend_start_loc")
OUTPUT_FIELDS = ("next_token_logits", "hidden_states", "last_hidden_states")
PARALLEL_FIELDS = ("attn_tp_rank", "attn_cp_rank")


# ---------------------------------------------------------------------------------------------
# Pieces of the real wheel
# ---------------------------------------------------------------------------------------------

def _class_node(source: str, name: str) -> ast.ClassDef:
    return next(n for n in ast.walk(ast.parse(source)) if isinstance(n, ast.ClassDef) and n.name == name)


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
    namespace = {"IntEnum": IntEnum, "auto": auto, "__name__": "forward_batch_info"}
    exec(compile(ast.Module([_class_node(fbi, "ForwardMode")], []), "forward_batch_info.py", "exec"),
         namespace)
    return SimpleNamespace(
        hook_manager=_load_wheel_module(sglang_wheel, "sglang/srt/model_executor/hook_manager.py",
                                        "sglang_hook_manager", tmp),
        aux=_load_wheel_module(sglang_wheel, "sglang/srt/layers/aux_hidden_states.py",
                               "sglang_aux_hidden_states", tmp),
        ForwardMode=namespace["ForwardMode"])


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


# ---------------------------------------------------------------------------------------------
# A fake target: the real hook registration path on a module tree with a logits_processor
# ---------------------------------------------------------------------------------------------

def make_model(pack):
    class LogitsProcessor(nn.Module):
        def forward(self, input_ids, hidden_states, lm_head, logits_metadata, aux_hidden_states=None):
            return SimpleNamespace(next_token_logits=lm_head(hidden_states),
                                   hidden_states=pack(aux_hidden_states) if aux_hidden_states else None,
                                   last_hidden_states=hidden_states if aux_hidden_states else None)

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
            ids.append(seq.tokens[prefix:prefix + n])
            for k in range(K):
                aux[k].append(seq.aux[k][prefix:prefix + n])
            last.append(seq.last[prefix:prefix + n])
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
        forward_mode=mode, batch_size=len(rows), input_ids=torch.cat(ids), rids=rids,
        positions=torch.cat([torch.arange(p, p + n) for p, n in zip(prefixes, lens)]),
        seq_lens=torch.tensor([p + n for p, n in zip(prefixes, lens)]),
        seq_lens_cpu=torch.tensor([p + n for p, n in zip(prefixes, lens)]),
        orig_seq_lens=torch.tensor([m[3] for m in meta], dtype=torch.int32),
        extend_num_tokens=sum(lens), extend_seq_lens=torch.tensor(lens, dtype=torch.int32),
        extend_seq_lens_cpu=lens, extend_prefix_lens=torch.tensor(prefixes, dtype=torch.int32),
        extend_prefix_lens_cpu=prefixes, extend_start_loc=starts.to(torch.int32))
    return fb, torch.cat(last), [torch.cat(a) for a in aux]


def forward(model, mode, rows, pad: int = 0, capture: bool = True):
    """One forward of the fake target; capture=False is a server without aux capture."""
    fb, last, aux = make_batch(mode, rows, pad)
    return model(fb.input_ids, last, fb, aux if capture else None)


def hook_specs(tmp: Path, dump_dir: Path) -> list[dict]:
    """The --forward-hooks JSON that eyas/server/launch.py emits, plus the keys it should pass."""
    from tests.stage_config import stage_config

    cfg = stage_config(tmp, tmp / "ckpt", **{"server.backend": "sglang", "server.dump_dir": str(dump_dir)})
    argv = shlex.split(launch_command(cfg))
    specs = json.loads(argv[argv.index("--forward-hooks") + 1])
    assert specs[0]["hook_factory"] == SGLANG_HOOK and specs[0]["target_modules"] == ["*logits_processor"]
    specs[0]["config"].update(layer_ids=LAYERS, dtype="float32")
    return specs


# ---------------------------------------------------------------------------------------------
# The fakes cannot drift from the wheel
# ---------------------------------------------------------------------------------------------

def test_fakes_use_only_names_the_wheel_defines(sglang_wheel):
    src = lambda member: wheel_text(sglang_wheel, f"sglang/srt/{member}")  # noqa: E731
    fbi = src("model_executor/forward_batch_info.py")
    assert set(FORWARD_BATCH_FIELDS) <= _class_fields(fbi, "ForwardBatch")
    assert "rids=[req.rid for req in batch.reqs]" in fbi
    assert set(OUTPUT_FIELDS) <= _class_fields(src("layers/logits_processor.py"), "LogitsProcessorOutput")
    assert set(PARALLEL_FIELDS) <= _class_fields(src("arg_groups/fields/parallel.py"), "Parallel")
    assert "def get_parallel() -> ParallelContext:" in src("runtime_context.py")
    assert "def get_exec() -> _ConfigBag:" in src("runtime_context.py")
    features = src("model_executor/model_runner_components/spec_aux_hidden_state.py")
    assert "features = get_exec().features" in features
    assert "features.return_aux_hidden_state_layer_ids" in features
    assert {"aux_hidden_state_capture", "return_aux_hidden_state_layer_ids"} <= _class_fields(
        src("arg_groups/fields/exec_.py"), "ExecFeatures")
    # the hook sees only positional args: the model must call the logits processor positionally
    assert ("self.logits_processor(\n                input_ids, hidden_states, self.lm_head, "
            "forward_batch, aux_hidden_states\n            )") in src("models/deepseek_v2.py")
    forward = next(n for n in _class_node(src("layers/logits_processor.py"), "LogitsProcessor").body
                   if isinstance(n, ast.FunctionDef) and n.name == "forward")
    assert [a.arg for a in forward.args.args[:6]] == ["self", "input_ids", "hidden_states", "lm_head",
                                                     "logits_metadata", "aux_hidden_states"]


def test_factory_matches_how_hook_manager_calls_it(sglang_wheel, sgl, installed):
    tree = ast.parse(wheel_text(sglang_wheel, "sglang/srt/model_executor/hook_manager.py"))
    calls = [n for n in ast.walk(tree) if isinstance(n, ast.Call)]
    [factory_call] = [c for c in calls if isinstance(c.func, ast.Name) and c.func.id == "hook_factory"]
    assert [ast.unparse(a) for a in factory_call.args] == ["config"] and not factory_call.keywords
    [register] = [c for c in calls if isinstance(c.func, ast.Attribute)
                  and c.func.attr == "register_forward_hook"]
    assert len(register.args) == 1 and not register.keywords  # so: hook(module, args, output)

    make_hook = sgl.hook_manager.resolve_callable(SGLANG_HOOK)  # the real resolver, real import
    assert make_hook is installed.mod.make_hook
    sig = inspect.signature(make_hook)
    sig.bind({"dump_dir": "/x"})
    assert all(p.kind is p.KEYWORD_ONLY and p.default is not p.empty
               for p in list(sig.parameters.values())[1:])
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
        assert sample.meta["layer_ids"] == LAYERS and sample.meta["layer_convention"] == "capture-before"
        assert sample.meta["last_hidden_norm"] == "post" and sample.meta["dtype"] == "float32"

    # a rid sent again (a new prefill starts at 0) is dumped again, despite its finished prefill
    forward(model, Mode.EXTEND, [(b, 0, 4)])
    hook.flush()
    assert assemble(read_records(dump_dir, b.rid), b.tokens.tolist()).meta["num_chunks"] == 1


@pytest.mark.parametrize("ranks, writes", [((0, 0), True), ((1, 0), False), ((0, 1), False)])
def test_only_attention_tp_rank_0_writes(tmp_path, sgl, installed, ranks, writes):
    model = make_model(sgl.aux.pack_aux_hidden_states)
    parallel = SimpleNamespace(**dict(zip(PARALLEL_FIELDS, ranks)))
    hook = installed.mod.make_hook({"dump_dir": str(tmp_path / "dump"), "layer_ids": LAYERS,
                                    "max_pending": 0}, parallel=parallel)
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
    with pytest.raises(installed.mod.HookError, match=r"SGLang captures \[2, 30, 58\]"):
        resolve([1, 29, 57], [1, 29, 57])
    with pytest.raises(installed.mod.HookError, match="no layer ids"):
        resolve(None, None)


def test_misconfiguration_fails_loudly(tmp_path, sgl, installed):
    mod, Mode = installed.mod, sgl.ForwardMode
    with pytest.raises(mod.HookError, match="unknown config keys"):
        mod.make_hook({"dump_dir": "/x", "layer_ids": LAYERS, "dumpdir": "/y"})
    with pytest.raises(mod.HookError, match="no dump_dir"):
        mod.make_hook({"layer_ids": LAYERS})
    # a server without --enable-return-aux-hidden-states fails at its first prefill (warmup)
    model = make_model(sgl.aux.pack_aux_hidden_states)
    model.logits_processor.register_forward_hook(
        mod.make_hook({"dump_dir": str(tmp_path), "layer_ids": LAYERS, "max_pending": 0}))
    warmup = Sequence("0d9e8f7a6b5c4d3e2f1a0b9c8d7e6f5a", 4, seed=6)
    with pytest.raises(mod.HookError, match="--enable-return-aux-hidden-states"):
        forward(model, Mode.EXTEND, [(warmup, 0, 4)], capture=False)
    # fewer captured layers than the hook was told
    model = make_model(sgl.aux.pack_aux_hidden_states)
    model.logits_processor.register_forward_hook(
        mod.make_hook({"dump_dir": str(tmp_path), "layer_ids": [*LAYERS, 6], "max_pending": 0}))
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
    assert "if _EYAS_DUMP_DIR and aux_hidden_states is not None:" in patched
    helper = next(n for n in ast.parse(patched).body
                  if isinstance(n, ast.FunctionDef) and n.name == "_eyas_dump")
    ns = {"_EYAS_DUMP_DIR": str(tmp_path / "dump"), "_eyas_dump_hook": None}
    exec(compile(ast.Module([helper], []), str(installed.site / DSV2), "exec"), ns)

    model = make_model(sgl.aux.pack_aux_hidden_states)
    target = SimpleNamespace(model=SimpleNamespace(layers_to_capture=LAYERS), lm_head=model.lm_head,
                             logits_processor=model.logits_processor)
    seq, again = Sequence("eyas-p", 5, seed=9), Sequence("eyas-q", 5, seed=10)

    def prefill(s):  # what the patched DeepseekV2ForCausalLM.forward does after the logits processor
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
