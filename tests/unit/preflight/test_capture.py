"""Launch arguments that would turn SGLang's prefill CUDA graph back on (and capture off) are
refused naming their field, checked against the real sglang 0.5.23 wheel's flags."""

from __future__ import annotations

import re

import pytest

from eyas.preflight import preflight
from eyas.preflight.capture import GRAPH_CONFIG, PREFILL_GRAPH_BACKEND, capture_flag_problems
from tests.tiny_config import fields, tiny

GRAPH = '{"prefill": {"backend": "breakable"}}'


def sglang(tmp_path, **overrides):
    return tiny(tmp_path, **{"server.backend": "sglang", **overrides})


@pytest.mark.parametrize(
    "field, args",
    [
        ("server.launch_args", ["--cuda-graph-backend-prefill", "breakable"]),
        ("server.launch_args", ["--cuda-graph-backend-prefill=full"]),
        (
            "server.launch_args",
            ["--cuda-graph-backend-pre", "full"],
        ),  # argparse takes the abbreviation
        ("server.capture_launch_args", ["--cuda-graph-config", GRAPH]),
        ("server.capture_launch_args", [f"--cuda-graph-config={GRAPH}"]),
        (
            "server.capture_launch_args",
            ["--cuda-graph-config", "prefill=full"],
        ),  # not JSON: cannot tell
    ],
)
def test_a_prefill_cuda_graph_in_the_capture_launch_is_refused_naming_its_field(
    tmp_path, field, args
):
    cfg = sglang(tmp_path, **{field: ["--tp-size", "8", *args]})
    problems = capture_flag_problems(cfg)
    assert [p.split(":", 1)[0] for p in problems] == [field]
    assert "--cuda-graph" in problems[0]
    if field == "server.launch_args":
        assert "benchmark.launch_args" in problems[0]  # where it may go: the serving launches only
    r = preflight(cfg)
    assert fields(r) == [field]


@pytest.mark.parametrize(
    "args",
    [
        ["--cuda-graph-backend-prefill", "disabled"],
        ["--cuda-graph-backend-decode", "full"],
        ["--cuda-graph-config", '{"decode": {"backend": "full", "max_bs": 8}}'],
        [
            "--cuda-graph-config",
            '{"prefill": {"max_bs": 8}}',
        ],  # no backend: --disable-prefill-cuda-graph holds
        ["--cuda-graph-config", '{"prefill": {"backend": "disabled"}}'],
        ["--disable-cuda-graph", "--cuda-graph-max-bs-prefill", "8"],
    ],
)
def test_graph_flags_that_leave_prefill_eager_pass(tmp_path, args):
    assert capture_flag_problems(sglang(tmp_path, **{"server.capture_launch_args": args})) == []


def test_serving_launch_args_and_the_local_backend_are_not_capture_launches(tmp_path):
    graph = ["--cuda-graph-backend-prefill", "full"]
    assert capture_flag_problems(sglang(tmp_path, **{"benchmark.launch_args": graph})) == []
    assert (
        capture_flag_problems(tiny(tmp_path, **{"server.launch_args": graph})) == []
    )  # eyas-local


def test_the_flags_are_sglang_0523s_own(sglang_wheel):
    """The names and abbreviations checked are the wheel's: its parser allows abbreviations, so the
    shortest prefix eyas takes for each must name that flag alone."""
    import zipfile

    with zipfile.ZipFile(sglang_wheel) as z:
        fields_src = z.read("sglang/srt/arg_groups/fields/exec_.py").decode()
        hook = z.read("sglang/srt/arg_groups/cuda_graph_hook.py").decode()
    flags = {
        "--" + n.replace("_", "-")
        for n in re.findall(
            r"^    ([a-z_]+): "
            r"A\[",
            fields_src,
            re.M,
        )
    }
    for full, shortest in (PREFILL_GRAPH_BACKEND, GRAPH_CONFIG):
        assert full in flags
        assert [f for f in flags if f.startswith(shortest)] == [full]
    # both win over --disable-prefill-cuda-graph: they are applied after it
    assert hook.index("cfg.disable_prefill_cuda_graph") < hook.index(
        "cfg.cuda_graph_backend_prefill"
    )
    assert hook.index("cfg.disable_prefill_cuda_graph") < hook.index("Explicit JSON config")
