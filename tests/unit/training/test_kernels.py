"""KernelOptions holds the user's choices and the step's optimisations, each the same step off; the
elementwise regions run eagerly or through torch.compile."""

import ast
import dataclasses
import importlib
import pkgutil
from pathlib import Path

import pytest
import torch

import eyas.training
from eyas.config import TrainingConfig
from eyas.training import kernels as fused
from eyas.training.kernels import KernelOptions, kernel_options
from eyas.training.losses import draft_first_order, teacher_labels
from eyas.training.target_head import TargetHead
from tests.helpers_training import training_config
from tests.unit.training.test_ttt_step import assert_same_step, loss_and_grads

torch.set_num_threads(1)


#: KernelOptions' fields that are the user's, each a training config field of the same name
CHOICES = {"compile", "fp8_gemms"}
#: the step's optimisations, each at a value that switches it off (or changes it)
OFF = {
    "skip_span": False,
    "gather_under": 0.0,
    "shared_emb": False,
    "emb_inplace": False,
    "grouped_gemms": False,
    "cudnn": False,
    "triton_ce": False,
    "teacher_cublaslt": False,
    "fused_clip": False,
}
#: the plain unroll the fused step is held to (losses.reference_ttt_loss), off by default
SPEC = {"reference": True}


def test_kernel_options_are_the_users_choices_and_the_steps_optimisations():
    """The user's choices are training config fields; the optimisations and the spec are not, each
    optimisation on by default, the spec off."""
    names = {f.name for f in dataclasses.fields(KernelOptions)}
    assert names == CHOICES | set(OFF) | set(SPEC)
    assert CHOICES <= set(TrainingConfig.model_fields)
    assert not (set(OFF) | set(SPEC)) & set(TrainingConfig.model_fields)
    assert all(getattr(KernelOptions(), n) != v for n, v in {**OFF, **SPEC}.items())


@pytest.mark.parametrize(
    "off", [{n: v} for n, v in {**OFF, **SPEC}.items()] + [{"gather_under": 1.0}], ids=str
)
def test_each_option_off_its_default_gives_the_same_loss_and_gradients(off):
    """The CPU's fp32 step with one optimisation off (cudnn, triton_ce and teacher_cublaslt act on
    CUDA only; fused_clip is the optimizer's, tests/unit/training/test_optim.py), or on the plain
    unroll: the default's loss, gradients and statistics."""
    assert_same_step(loss_and_grads(KernelOptions(**off)), loss_and_grads(), atol=1e-6, rtol=1e-4)


def test_kernel_options_follow_the_training_config(tmp_path):
    cpu, gpu = torch.device("cpu"), torch.device("cuda", 0)
    assert (
        kernel_options(training_config(tmp_path), cpu) == KernelOptions()
    )  # compile: None = on a GPU only
    assert kernel_options(training_config(tmp_path), gpu) == KernelOptions(compile=True)
    assert kernel_options(training_config(tmp_path, compile=True), cpu).compile
    assert not kernel_options(training_config(tmp_path, compile=False), gpu).compile
    assert not kernel_options(training_config(tmp_path), cpu).fp8_gemms
    assert kernel_options(training_config(tmp_path, fp8_gemms=True), gpu).fp8_gemms
    with pytest.raises(dataclasses.FrozenInstanceError):
        KernelOptions().compile = True


def test_compile_routes_every_region_through_torch_compile(monkeypatch):
    """compile=True sends the elementwise regions through torch.compile (stubbed here to return the
    function itself: the CPU would spend minutes compiling), with the same loss and gradients."""
    seen = []

    def fake_compile(fn, **kw):
        seen.append(fn.__name__)
        return fn

    monkeypatch.setattr(torch, "compile", fake_compile)
    monkeypatch.setattr(fused, "_compiled", {})
    eager = loss_and_grads(KernelOptions())
    assert not seen
    assert_same_step(loss_and_grads(KernelOptions(compile=True)), eager, atol=1e-7, rtol=1e-6)
    assert {
        "norm",
        "add_norm",
        "add_rope",
        "swiglu",
        "diag_forward",
        "diag_backward",
        "_soft_ce_torch",
    } <= set(seen)
    seen.clear()  # every step projecting its own concatenation (the FP8 GEMMs' path)
    fused._compiled.clear()
    assert_same_step(
        loss_and_grads(KernelOptions(compile=True, shared_emb=False)),
        loss_and_grads(KernelOptions(shared_emb=False)),
        atol=1e-7,
        rtol=1e-6,
    )
    assert {"norm", "add_norm", "add_rope", "swiglu"} <= set(seen)


def test_compile_routes_the_teachers_softmax_through_torch_compile(monkeypatch):
    """The teacher's argmax, max and softmax are one compiled region (stubbed as above): same
    labels."""
    seen = []
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: seen.append(fn.__name__) or fn)
    monkeypatch.setattr(fused, "_compiled", {})
    g = torch.Generator().manual_seed(5)
    t2d = torch.zeros(64, dtype=torch.bool)
    t2d[torch.randperm(64, generator=g)[:40]] = True
    head = TargetHead(torch.randn(64, 32, generator=g), None, 1e-6).reorder(draft_first_order(t2d))
    last, mask = torch.randn(2, 9, 32, generator=g), torch.rand(2, 9, generator=g) > 0.2
    eager = teacher_labels(head, last, mask, 40, chunk=5)
    compiled = teacher_labels(head, last, mask, 40, chunk=5, kernels=KernelOptions(compile=True))
    assert seen == ["teacher_softmax"]
    assert torch.equal(compiled.target, eager.target) and torch.equal(compiled.probs, eager.probs)


#: Module-level state that eyas/training may keep: caches and memos of what this process found, none
#: a choice.
MEMOS = {
    ("attention", "_refused"),
    ("kernels", "_compiled"),
    ("gemm", "FP32_OUT"),
    ("target_head", "_NAMES"),
    ("target_head", "_PREFIXES"),  # these two: constant lookup tables
}
#: Module-level strings that are names, not choices: a file name, its format tag, a thread name.
NAMES = {("checkpoints", "SUMS"), ("checkpoints", "SUMS_FORMAT"), ("loader", "THREAD_PREFIX")}


def test_no_module_level_switch_is_left():
    for info in pkgutil.iter_modules(eyas.training.__path__):
        module = importlib.import_module(f"eyas.training.{info.name}")
        for name, value in vars(module).items():
            if name.startswith("__") or name == "TYPE_CHECKING":
                continue
            if (info.name, name) not in NAMES:
                assert not isinstance(value, (bool, str)), f"{info.name}.{name}"  # a flag or a mode
            if isinstance(value, (dict, list, set)):
                assert (info.name, name) in MEMOS, f"{info.name}.{name}"
        tree = ast.parse(Path(module.__file__).read_text())
        rebound = {n for node in ast.walk(tree) if isinstance(node, ast.Global) for n in node.names}
        assert rebound <= ({"_ce_kernel"} if info.name == "soft_ce" else set()), (
            info.name,
            rebound,
        )
