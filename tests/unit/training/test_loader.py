"""The data path behind the step (eyas/training/loader.py): the same batches, order and training as
the synchronous collate, each rank reading only its micro-batches, and no thread left on any way
out."""

import itertools
import os
import shutil
import signal
import struct
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from eyas.extraction.shards import Sample, ShardError, write_shard
from eyas.training.batches import Batch, ShardData, collate
from eyas.training.loader import BatchLoader, dequantize, plan_steps, threads_left
from eyas.training.train import train_drafter
from tests.helpers_training import shard_meta, target_config, training_config

torch.set_num_threads(1)
H, K = 16, 3


def random_samples(n: int, seed: int, dtype=torch.bfloat16) -> list[Sample]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        T = int(torch.randint(5, 30, (1,), generator=g))
        scale = torch.logspace(-2, 2, T).unsqueeze(
            1
        )  # per-token norms over four decades, as residual streams
        out.append(
            Sample(
                torch.randint(0, 500, (T,), generator=g),
                torch.rand(T, generator=g) > 0.3,
                (torch.randn(T, K * H, generator=g) * scale).to(dtype),
                (torch.randn(T, H, generator=g) * scale).to(dtype),
            )
        )
    return out


@pytest.fixture(scope="module")
def shard_sets(tmp_path_factory):
    """The same 18 samples as bf16, fp32 and FP8 shards (two files each, the last sample of each a
    zero row to check that padding and zeros stay zeros)."""
    root = tmp_path_factory.mktemp("loader-shards")
    sets = {}
    for name, dtype, enc in (
        ("bf16", torch.bfloat16, "plain"),
        ("fp32", torch.float32, "plain"),
        ("fp8", torch.bfloat16, "fp8_e4m3"),
    ):
        samples = random_samples(18, seed=1, dtype=dtype)
        samples[-1].aux_hidden_states.zero_()
        paths = []
        for s in range(2):
            p = root / name / f"shard-{s:05d}.safetensors"
            write_shard(p, samples[s * 9 : (s + 1) * 9], shard_meta(), encoding=enc)
            paths.append(p)
        sets[name] = paths
    return sets


def same(a: Batch, b: Batch) -> bool:
    return a.sample_ids == b.sample_ids and all(
        torch.equal(x, y) and x.dtype == y.dtype for x, y in zip(a.tensors(), b.tensors())
    )


@pytest.mark.parametrize("kind", ["bf16", "fp32", "fp8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("all_positions", [False, True], ids=["mask", "all"])
def test_batches_are_bit_for_bit_those_of_collate_in_plan_order(
    shard_sets, kind, dtype, all_positions
):
    data = ShardData(shard_sets[kind], num_validation=2, ttt_steps=2, all_positions=all_positions)
    steps = list(
        itertools.islice(
            plan_steps(data.lengths, data.train_ids, 3, 2, seed=5, epoch=0, pos=1, window=2), 7
        )
    )
    assert [(e, p) for e, p, _ in steps] == [(0, 1), (1, 0), (1, 1), (2, 0), (2, 1), (3, 0), (3, 1)]
    with BatchLoader(data, steps, "cpu", dtype, workers=3, ahead=3) as loader:
        got = list(loader)
    assert [item for item, _ in got] == steps
    for (_, _, micro), batches in got:
        assert len(batches) == 2
        for m, b in zip(micro, batches):
            assert same(b, collate([data.sample(i) for i in m], "cpu", dtype, ids=m)), m
    assert loader.read_bytes > 0 and not threads_left()


def test_fp8_is_dequantized_as_the_reader_does():
    g = torch.Generator().manual_seed(3)
    from eyas.extraction import fp8

    x = torch.randn(2, 7, 3 * 8, generator=g) * torch.logspace(-3, 3, 7).view(1, 7, 1)
    q, s = zip(*(fp8.quantize(x[b], 3) for b in range(2)))
    q, s = torch.stack(q), torch.stack(s)
    for dtype in (torch.bfloat16, torch.float32):
        want = torch.stack([fp8.dequantize(q[b], s[b], torch.bfloat16).to(dtype) for b in range(2)])
        assert torch.equal(dequantize(q.view(torch.uint8), s, dtype), want)


def test_each_rank_reads_only_its_micro_batches(shard_sets):
    data = ShardData(shard_sets["bf16"], num_validation=0)
    steps = list(
        itertools.islice(plan_steps(data.lengths, data.train_ids, 2, 4, seed=0, epoch=0, pos=0), 3)
    )
    read = {}
    for rank in (0, 1):
        loader = BatchLoader(data, steps, "cpu", torch.float32, rank=rank, world=2, workers=2)
        seen = []
        original = loader.host_batch
        loader.host_batch = lambda ids, f=original, seen=seen: (seen.append(list(ids)), f(ids))[1]
        with loader:
            out = list(loader)
        assert [[b.sample_ids for b in batches] for _, batches in out] == [
            s[-1][rank::2] for s in steps
        ]
        read[rank] = sorted(map(tuple, seen))
    assert read[0] == sorted(tuple(m) for s in steps for m in s[-1][0::2])
    assert read[1] == sorted(tuple(m) for s in steps for m in s[-1][1::2])
    assert not set(read[0]) & set(read[1])


def test_shards_stored_in_several_ways_batch_as_collate_does(shard_sets):
    data = ShardData([shard_sets["bf16"][0], shard_sets["fp8"][1]], num_validation=0)
    steps = list(
        itertools.islice(plan_steps(data.lengths, data.train_ids, 6, 1, seed=0, epoch=0, pos=0), 3)
    )
    with BatchLoader(data, steps, "cpu", torch.float32, workers=2) as loader:
        got = list(loader)
    index = data.index
    assert any(len({index[i][0].encoding for i in m}) > 1 for _, _, (m,) in steps)
    for (_, _, (m,)), (b,) in got:
        assert same(b, collate([data.sample(i) for i in m], "cpu", torch.float32, ids=m)), m


def test_a_worker_error_reaches_the_step_and_no_thread_is_left(shard_sets, tmp_path):
    paths = [tmp_path / p.name for p in shard_sets["bf16"]]
    for src, dst in zip(shard_sets["bf16"], paths):
        shutil.copy(src, dst)
    data = ShardData(paths, num_validation=0)
    steps = list(
        itertools.islice(plan_steps(data.lengths, data.train_ids, 2, 1, seed=0, epoch=0, pos=0), 6)
    )
    cut = tmp_path / "cut"
    cut.write_bytes(paths[1].read_bytes()[:4096])
    os.replace(cut, paths[1])  # the second file loses its tail after ShardData read its offsets
    with pytest.raises(OSError, match="short read"):
        with BatchLoader(data, steps, "cpu", torch.float32, workers=2) as loader:
            for _ in loader:
                pass
    assert not threads_left()


def test_a_malformed_shard_header_reaches_the_step_naming_the_shard(shard_sets, tmp_path):
    paths = [tmp_path / p.name for p in shard_sets["bf16"]]
    for src, dst in zip(shard_sets["bf16"], paths):
        shutil.copy(src, dst)
    data = ShardData(paths, num_validation=0)
    steps = list(
        itertools.islice(plan_steps(data.lengths, data.train_ids, 2, 1, seed=0, epoch=0, pos=0), 6)
    )
    bad = tmp_path / "bad"
    bad.write_bytes(struct.pack("<Q", 3) + b"{x}" + bytes(64))
    os.replace(bad, paths[1])  # after ShardData read its offsets
    with pytest.raises(ShardError, match=rf"^{paths[1]}: not a readable safetensors header"):
        with BatchLoader(data, steps, "cpu", torch.float32, workers=2) as loader:
            for _ in loader:
                pass
    assert not threads_left()


def test_closing_mid_epoch_drops_what_was_read_ahead(shard_sets):
    data = ShardData(shard_sets["fp8"], num_validation=0)
    steps = plan_steps(data.lengths, data.train_ids, 2, 1, seed=0, epoch=0, pos=0)  # endless
    with pytest.raises(KeyboardInterrupt):
        with BatchLoader(data, steps, "cpu", torch.float32, workers=3, ahead=4) as loader:
            for i, _ in enumerate(loader):
                if i == 2:
                    raise KeyboardInterrupt
    assert not threads_left() and loader._stop.is_set()


def test_training_is_bit_for_bit_the_synchronous_path_and_resumes(sharp_target, shards, tmp_path):
    """loader_workers 0 (collate inside the step, as before the loader) and 3, with aux noise (the
    RNG's order): the same losses and weights; interrupted at step 3 and resumed with the loader:
    the same."""
    tgt = target_config(sharp_target)
    cfg = lambda d, w: training_config(  # noqa: E731
        tmp_path / d,
        max_steps=7,
        checkpoint_every=3,
        batch_size=3,
        aux_noise=0.1,
        loader_workers=w,
        teacher_cache_gb=0,
        num_validation_sequences=2,
    )
    sync = train_drafter(cfg("sync", 0), tgt, shards, log=lambda _: None)
    logs = []
    overlapped = train_drafter(cfg("loader", 3), tgt, shards, log=logs.append)
    assert overlapped.losses == sync.losses and overlapped.accuracies == sync.accuracies
    assert any("waiting for data" in line for line in logs)
    part = train_drafter(cfg("resumed", 2), tgt, shards, log=lambda _: None, stop_at_step=4)
    shutil.rmtree(tmp_path / "resumed" / "checkpoints" / "step-000004")  # lost: resumed from step 3
    resumed = train_drafter(cfg("resumed", 2), tgt, shards, log=lambda _: None)
    assert part.steps == 4 and resumed.resumed_from_step == 3 and resumed.losses == sync.losses
    for r in (overlapped, resumed):
        wa, wb = (
            load_file(f"{sync.checkpoint_dir}/model.safetensors"),
            load_file(f"{r.checkpoint_dir}/model.safetensors"),
        )
        assert all(torch.equal(wa[k], wb[k]) for k in wa)
    assert not threads_left()


def test_fp8_shards_train_as_the_reader_dequantizes_them(sharp_target, shards, tmp_path):
    fp8 = []
    for p in shards:
        data = ShardData([p], num_validation=0)
        q = tmp_path / "fp8" / p.name
        write_shard(
            q,
            [data.sample(i) for i in range(len(data.lengths))],
            dict(data.readers[0].meta),
            encoding="fp8_e4m3",
        )
        fp8.append(q)
    tgt = target_config(sharp_target)
    runs = [
        train_drafter(
            training_config(
                tmp_path / f"w{w}",
                max_steps=4,
                batch_size=3,
                loader_workers=w,
                checkpoint_every=100,
            ),
            tgt,
            fp8,
            log=lambda _: None,
        )
        for w in (0, 2)
    ]
    assert runs[0].losses == runs[1].losses


def test_an_exception_in_training_leaves_no_loader_thread(sharp_target, shards, tmp_path):
    class Boom(Exception):
        pass

    def on_step(s):
        if s.step == 2:
            assert threads_left()  # the loader is running
            raise Boom

    with pytest.raises(Boom):
        train_drafter(
            training_config(tmp_path / "t", max_steps=6, loader_workers=2, checkpoint_every=100),
            target_config(sharp_target),
            shards,
            log=lambda _: None,
            on_step=on_step,
        )
    assert not threads_left()


SIGTERM_SCRIPT = textwrap.dedent("""
    import faulthandler, signal, sys, threading
    import torch
    from pathlib import Path
    from eyas.training.loader import threads_left
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # the test asks where a hang is
    from eyas.training.train import train_drafter
    from tests.helpers_training import target_config, training_config
    torch.set_num_threads(1)
    signal.signal(signal.SIGTERM, lambda *a: sys.exit(143))  # as a supervisor's handler ends a run
    target, out, *shards = sys.argv[1:]
    def on_step(s):
        print(f"step {s.step}", flush=True)
    try:
        cfg = training_config(Path(out), max_steps=10000, loader_workers=2, checkpoint_every=100000)
        train_drafter(cfg, target_config(Path(target)), [Path(p) for p in shards],
                      log=lambda _: None, on_step=on_step)
    finally:
        print(f"threads left: {threads_left()}", flush=True)
""")


def test_sigterm_mid_training_ends_the_process_with_no_loader_thread(
    sharp_target, shards, tmp_path
):
    script = tmp_path / "run.py"
    script.write_text(SIGTERM_SCRIPT)
    env = {
        **os.environ,
        "PYTHONPATH": str(Path(__file__).resolve().parents[3]),
        "OMP_NUM_THREADS": "1",
    }
    p = subprocess.Popen(
        [sys.executable, str(script), str(sharp_target), str(tmp_path / "out"), *map(str, shards)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
    )
    try:
        for line in p.stdout:
            if line.startswith("step 2"):
                p.send_signal(signal.SIGTERM)
                break
        try:
            out, _ = p.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            p.send_signal(signal.SIGUSR1)  # every thread's stack, then fail with it
            time.sleep(2)
            p.kill()
            raise AssertionError(
                "no exit 60 s after SIGTERM; stacks:\n" + p.communicate()[0][-6000:]
            ) from None
    finally:
        p.kill()
    assert p.returncode == 143, out
    assert "threads left: []" in out, out


def test_no_thread_outlives_the_tests():
    assert not [t for t in threading.enumerate() if t.name.startswith("eyas-loader")]


def last_json(cmd: list[str]) -> dict:
    import json

    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = subprocess.run(
        [sys.executable, *cmd],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
        cwd=Path(__file__).resolve().parents[3],
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_the_loader_bench_runs_tiny(tmp_path):
    line = last_json(
        [
            "bench/loader.py",
            "--tiny",
            "--batch",
            "2",
            "--repeat",
            "2",
            "--workers",
            "1",
            "--dir",
            str(tmp_path),
        ]
    )
    assert line["bench"] == "loader" and set(line["figures"]) >= {"plain", "fp8_e4m3"}
    assert line["figures"]["fp8_e4m3"]["worker_reused_buffers"]["warm_gb_s"] > 0
    assert not list(tmp_path.iterdir())  # its shards removed


def test_the_train_bench_from_shards_runs_tiny(tmp_path):
    line = last_json(
        [
            "bench/train.py",
            "--from-shards",
            "--steps",
            "1",
            "--warmup",
            "1",
            "--shard-batches",
            "2",
            "--shard-sequences",
            "4",
            "--shard-dir",
            str(tmp_path / "shards"),
        ]
    )
    goals = line["goals"]
    assert goals["loader_matches_collate"]["met"]
    assert {"shards_bf16_b2_cold", "shards_fp8_b2_warm"} <= set(goals) and goals[
        "shards_bf16_b2_cold"
    ]["goal"] == ">= 0.97"
    assert line["figures"]["from_shards"]["rows"][0]["plain"]["cold"]["steps"] == 2
