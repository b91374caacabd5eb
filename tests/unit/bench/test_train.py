"""bench/masks.py's chat-shaped loss masks and bench/train.py's goal line (CPU smoke run)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))

from bench import masks  # noqa: E402 - bench/ is a folder of scripts, found through sys.path


def test_prefix_masks_shape_and_share():
    for f, T in ((1 / 16, 4096), (0.3, 4096), (0.0, 64), (0.3, 64)):
        m = masks.prefix_masks(3, T, f)
        assert m.shape == (3, T) and m.dtype == np.bool_
        assert masks.unscored_share(m) == pytest.approx(round(f * T) / T)
        assert (
            not m[:, : round(f * T)].any() and m[:, round(f * T) :].all()
        )  # a leading prompt only
    with pytest.raises(ValueError):
        masks.prefix_masks(1, 64, 1.0)


def test_pack_keeps_order_and_drops_the_tail():
    convs = [[0, 0, 1, 1, 1], [0, 1, 1], [0, 0, 0, 1, 1, 1, 1]]  # 15 tokens, 10 scored
    m = masks.pack(convs, 4)
    assert m.shape == (3, 4)
    assert m.reshape(-1).tolist() == [bool(x) for c in convs for x in c][:12]
    with pytest.raises(ValueError):
        masks.pack([[1, 1]], 4)


def test_conversation_masks_are_eyas_loss_masks_packed(tmp_path):
    convs = masks.conversation_masks(
        ROOT / "fixtures/data/conversations.jsonl", ROOT / "fixtures/tiny-target", 512
    )
    assert len(convs) == 468  # 500 lines, 32 held out, as local-tiny prepares them
    m = masks.pack(convs, 512)
    total = sum(len(c) for c in convs)
    assert m.shape == (total // 512, 512)
    share = masks.unscored_share(m)
    assert 0.3 < share < 0.8  # user turns and template tokens between replies
    assert (m.mean(1) > 0).sum() > 0.9 * len(m) and (~m).any(
        1
    ).mean() > 0.9  # nearly every row has both
    path = tmp_path / "masks.npy"
    np.save(path, m, allow_pickle=False)
    again = masks.load_masks(path, 512)
    assert np.array_equal(again, m)
    recut = masks.load_masks(path, 64)  # the same stream in shorter rows
    assert recut.shape == (m.size // 64, 64) and np.array_equal(recut.reshape(-1), m.reshape(-1))


def test_goal_json_is_well_formed(tmp_path):
    m = masks.pack(
        masks.conversation_masks(
            ROOT / "fixtures/data/conversations.jsonl", ROOT / "fixtures/tiny-target", 256
        ),
        256,
    )
    np.save(tmp_path / "m.npy", m, allow_pickle=False)
    out = subprocess.run(
        [
            sys.executable,
            str(ROOT / "bench/train.py"),
            "--device",
            "cpu",
            "--steps",
            "1",
            "--batches",
            "1",
            "--masks-from",
            str(tmp_path / "m.npy"),
            "--prompt-fraction",
            "0.125",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
        check=False,
        env={"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"},
    )
    assert out.returncode == 0, out.stderr[-3000:]
    line = json.loads(
        out.stdout.strip().splitlines()[-1],
        parse_constant=lambda c: pytest.fail(f"{c} is not JSON"),
    )  # NaN would fail here
    assert line["bench"] == "train" and set(line) == {"bench", "figures", "goals"}
    for name, g in line["goals"].items():
        assert set(g) >= {"value", "goal", "met"} and isinstance(g["met"], bool), name
        assert g["goal"].split()[0] in (">=", "<=", "fits"), name
    for key in (
        "chat_masks_b1_2x_specforge",
        "chat_masks_b4_2x_specforge",
        "all_scored_b4_1.5x_specforge",
    ):
        assert line["goals"][key]["met"] is False  # the tiny drafter meets no Kimi-size goal
    rows = {(r["mask"], r["batch"], r["variant"]): r for r in line["figures"]["mask_rows"]}
    assert set(rows) == {
        (k, b, v)
        for k in ("all-scored", "prompt-0.3", "masks-from")
        for b in (1, 2)
        for v in ("default", "nomemo")
    }  # later epochs, and a first
    rows = {(m, b): r for (m, b, v), r in rows.items() if v == "default"}
    assert rows[("all-scored", 1)]["unscored_share"] == 0
    assert rows[("prompt-0.3", 2)]["unscored_share"] == pytest.approx(0.3, abs=0.02)
    assert all(r["tokens_per_s"] > 0 for r in rows.values())
    assert line["figures"]["batches"][0]["unscored_share"] == pytest.approx(0.125)


def test_goals_judge_a_whole_run_from_its_first_and_later_epochs():
    """The default's goals average a run of --epochs: one first epoch (the `nomemo` row) and the
    rest (the default's row, the teacher's argmax bit remembered); without the first epoch's row, no
    value."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_train", ROOT / "bench" / "train.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    assert bench.run_average(20000.0, 21000.0, 10) == pytest.approx(10 / (1 / 20000 + 9 / 21000))
    assert bench.run_average(20000.0, 21000.0, 1) == pytest.approx(20000.0)
    rows = [
        {"mask": "prompt-0.3", "batch": 4, "variant": "default", "tokens_per_s": 21000.0},
        {"mask": "prompt-0.3", "batch": 4, "variant": "nomemo", "tokens_per_s": 20000.0},
        {"mask": "all-scored", "batch": 4, "variant": "default", "tokens_per_s": 16000.0},
    ]
    goals = bench.specforge_goals(rows, tiny=False, epochs=10)
    g = goals["prompt30_b4_2x_specforge"]
    assert (
        g["value"] == pytest.approx(20895.5, abs=0.1) and g["met"]
    )  # 20,800 needed: the run meets it
    assert (g["first_epoch"], g["later_epochs"], g["epochs"]) == (20000.0, 21000.0, 10)
    assert not bench.specforge_goals(rows, tiny=False, epochs=2)["prompt30_b4_2x_specforge"][
        "met"
    ]  # 20,488
    a = goals["all_scored_b4_1.5x_specforge"]
    assert (
        a["value"] is None and not a["met"] and a["later_epochs"] == 16000.0
    )  # no first epoch measured
    first = bench.specforge_goals(rows, tiny=False, variant_name="nomemo")
    assert first["prompt30_b4_2x_specforge_nomemo"]["value"] == 20000.0
    assert not first["prompt30_b4_2x_specforge_nomemo"]["met"]


def test_each_variant_is_a_kernel_options_and_bench_patches_nothing():
    """bench/train.py builds an optimisation's absence as a KernelOptions whose field switches it
    off, never by patching eyas's code (no unittest.mock in bench/); on the CPU each variant's step
    but fp8's (not the same arithmetic) computes the default's loss and gradients."""
    import dataclasses

    from bench import train as bench
    from eyas.training.kernels import KernelOptions
    from tests.unit.training.test_ttt_step import assert_same_step, loss_and_grads

    for path in (ROOT / "bench").glob("*.py"):
        assert "unittest" not in path.read_text(), path.name
    fields = {f.name for f in dataclasses.fields(KernelOptions)}
    base = loss_and_grads()
    for name, v in bench.VARIANTS.items():
        assert set(v) <= {"kernels", "memo", "head_chunk"} and set(v.get("kernels", {})) <= fields
        kernels = bench.variant(name, compile_on=False)
        assert kernels == KernelOptions(**v.get("kernels", {}))
        if v.get("kernels") and name != "fp8":
            assert_same_step(loss_and_grads(kernels), base, atol=1e-6, rtol=1e-4)


# The lent GPU's python holds torch, safetensors and numpy but neither pydantic, prefect nor pyyaml:
# the training benches import the training path alone, and a config import on it stops them there.
BARE_GPU_PYTHON = """
import importlib.abc, importlib.util, sys
class Absent(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name.split(".")[0] in ("pydantic", "prefect", "yaml", "fabric"):
            raise ModuleNotFoundError(f"No module named {name!r}")
sys.meta_path.insert(0, Absent())
sys.path.insert(0, sys.argv[1])
for script in ("train", "train_goal_rows"):
    spec = importlib.util.spec_from_file_location(script, f"{sys.argv[1]}/bench/{script}.py")
    spec.loader.exec_module(importlib.util.module_from_spec(spec))
print("imported")
"""


def test_the_training_benches_import_on_a_gpu_hosts_bare_python():
    out = subprocess.run(
        [sys.executable, "-c", BARE_GPU_PYTHON, str(ROOT)], capture_output=True, text=True
    )
    assert out.stdout.strip() == "imported", out.stderr[-2000:]
