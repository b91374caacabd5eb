"""eyas preflight's capture checks: launch arguments that would turn SGLang's prefill CUDA graph back
on (and capture off) are refused naming their field, checked against the real sglang 0.5.23 wheel's
flags; server.dump_dir's filesystem is measured on the server host (here a local one, with the real
/dev/shm) against the dump records extraction keeps there. The SSH form of the dump check is in
tests/integration/test_preflight_dump_dir.py."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from eyas.preflight import (GRAPH_CONFIG, PREFILL_GRAPH_BACKEND, SHARDS_AT_ONCE, capture_flag_problems,
                            dump_bytes_needed, preflight)
from tests.unit.test_preflight import fields, tiny

GRAPH = '{"prefill": {"backend": "breakable"}}'


def sglang(tmp_path, **overrides):
    return tiny(tmp_path, **{"server.backend": "sglang", **overrides})


@pytest.mark.parametrize("field, args", [
    ("server.launch_args", ["--cuda-graph-backend-prefill", "breakable"]),
    ("server.launch_args", ["--cuda-graph-backend-prefill=full"]),
    ("server.launch_args", ["--cuda-graph-backend-pre", "full"]),  # argparse takes the abbreviation
    ("server.capture_launch_args", ["--cuda-graph-config", GRAPH]),
    ("server.capture_launch_args", [f"--cuda-graph-config={GRAPH}"]),
    ("server.capture_launch_args", ["--cuda-graph-config", "prefill=full"]),  # not JSON: cannot tell
])
def test_a_prefill_cuda_graph_in_the_capture_launch_is_refused_naming_its_field(tmp_path, field, args):
    cfg = sglang(tmp_path, **{field: ["--tp-size", "8", *args]})
    problems = capture_flag_problems(cfg)
    assert [p.split(":", 1)[0] for p in problems] == [field]
    assert "--cuda-graph" in problems[0]
    if field == "server.launch_args":
        assert "benchmark.launch_args" in problems[0]  # where it may go: the serving launches only
    r = preflight(cfg)
    assert fields(r) == [field]


@pytest.mark.parametrize("args", [
    ["--cuda-graph-backend-prefill", "disabled"],
    ["--cuda-graph-backend-decode", "full"],
    ["--cuda-graph-config", '{"decode": {"backend": "full", "max_bs": 8}}'],
    ["--cuda-graph-config", '{"prefill": {"max_bs": 8}}'],  # no backend: --disable-prefill-cuda-graph holds
    ["--cuda-graph-config", '{"prefill": {"backend": "disabled"}}'],
    ["--disable-cuda-graph", "--cuda-graph-max-bs-prefill", "8"],
])
def test_graph_flags_that_leave_prefill_eager_pass(tmp_path, args):
    assert capture_flag_problems(sglang(tmp_path, **{"server.capture_launch_args": args})) == []


def test_serving_launch_args_and_the_local_backend_are_not_capture_launches(tmp_path):
    graph = ["--cuda-graph-backend-prefill", "full"]
    assert capture_flag_problems(sglang(tmp_path, **{"benchmark.launch_args": graph})) == []
    assert capture_flag_problems(tiny(tmp_path, **{"server.launch_args": graph})) == []  # eyas-local


def test_the_flags_are_sglang_0523s_own(sglang_wheel):
    """The names and abbreviations checked are the wheel's: its parser allows abbreviations, so the
    shortest prefix eyas takes for each must name that flag alone."""
    import zipfile

    with zipfile.ZipFile(sglang_wheel) as z:
        fields_src = z.read("sglang/srt/arg_groups/fields/exec_.py").decode()
        hook = z.read("sglang/srt/arg_groups/cuda_graph_hook.py").decode()
    flags = {"--" + n.replace("_", "-") for n in re.findall(r"^    ([a-z_]+): A\[", fields_src, re.M)}
    for full, shortest in (PREFILL_GRAPH_BACKEND, GRAPH_CONFIG):
        assert full in flags
        assert [f for f in flags if f.startswith(shortest)] == [full]
    # both win over --disable-prefill-cuda-graph: they are applied after it
    assert hook.index("cfg.disable_prefill_cuda_graph") < hook.index("cfg.cuda_graph_backend_prefill")
    assert hook.index("cfg.disable_prefill_cuda_graph") < hook.index("Explicit JSON config")


def test_the_dump_bytes_extraction_keeps_at_once():
    from eyas.config import load_config
    from tests.stage_config import ROOT

    cfg = load_config(ROOT / "configs" / "kimi-k2.5-sglang.yaml", {"data.max_length": 4096})
    need, sequences, per_token = dump_bytes_needed(cfg, 7168)
    assert per_token == 4 * 7168 * 2 + 4  # 3 aux layers + the last in bf16, an int32 id
    assert 4096 * per_token == pytest.approx(235e6, rel=0.001)  # one 4k-token sequence: ~235 MB
    x = cfg.extraction
    assert sequences == x.concurrency + SHARDS_AT_ONCE * x.collect_workers == 12
    assert need == sequences * 4096 * per_token


SHM = Path("/dev/shm")


@pytest.mark.skipif(not SHM.is_dir(), reason="no /dev/shm on this machine")
def test_a_dump_dir_too_small_for_the_capture_is_refused_naming_folder_free_bytes_and_need(tmp_path):
    dump = SHM / f"eyas-test-{tmp_path.name}" / "dump"  # not created: its nearest existing parent is measured
    ok = preflight(tiny(tmp_path, **{"server.dump_dir": str(dump)}))
    assert "server.dump_dir" not in fields(ok)
    cfg = tiny(tmp_path, **{"server.dump_dir": str(dump), "extraction.concurrency": 10**6})
    r = preflight(cfg)
    assert fields(r) == ["server.dump_dir"]
    need, _, _ = dump_bytes_needed(cfg, 256)
    problem = r.problems[0]
    assert f"{SHM} on localhost has " in problem and f"{need:,} bytes" in problem
    free = int(re.search(r"has ([\d,]+) bytes", problem)[1].replace(",", ""))
    assert 0 < free < need and "extraction.concurrency=1000000" in problem
    assert "--shm-size" in problem  # bigger than the filesystem itself: the container's flag
