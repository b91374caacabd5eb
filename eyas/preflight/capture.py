"""SGLang launch arguments that would silently turn hidden-state capture off."""

from __future__ import annotations

import json

from eyas.config import PipelineConfig

#: SGLang 0.5.23 flags that choose the prefill CUDA graph (arg_groups/fields/exec_.py), with the
#: shortest prefix argparse takes for each (its parser allows abbreviations; nothing else starts so)
PREFILL_GRAPH_BACKEND = ("--cuda-graph-backend-prefill", "--cuda-graph-backend-p")
GRAPH_CONFIG = ("--cuda-graph-config", "--cuda-graph-c")


def _is_flag(name: str, flag: tuple[str, str]) -> bool:
    """name (before any "=") is the flag or an abbreviation argparse would take for it."""
    full, shortest = flag
    return full.startswith(name) and len(name) >= len(shortest)


def capture_flag_problems(cfg: PipelineConfig) -> list[str]:
    """Arguments of the capture launch (server.launch_args, server.capture_launch_args) that turn
    SGLang's prefill CUDA graph back on. The capture launch passes --disable-prefill-cuda-graph
    because eyas's dump hook (and a source-patched model file) run only in eager forwards: a
    replayed graph skips the Python code, so its requests come back without dump records. In 0.5.23
    an explicit --cuda-graph-backend-prefill, and a --cuda-graph-config JSON naming a prefill
    backend, both win over --disable-prefill-cuda-graph whatever their order (model_executor/
    cuda_graph_config.py, arg_groups/cuda_graph_hook.py _parse_cuda_graph_config)."""
    s = cfg.server
    if s.backend != "sglang":
        return []
    out = []
    for where, args in (
        ("server.launch_args", s.launch_args),
        ("server.capture_launch_args", s.capture_launch_args),
    ):
        fix = (
            "move it to benchmark.launch_args, which only the serving launches get"
            if where == "server.launch_args"
            else "remove it"
        )
        for i, token in enumerate(args):
            if not token.startswith("--"):
                continue
            name, eq, value = token.partition("=")
            if not eq:
                value = args[i + 1] if i + 1 < len(args) else ""
            if _is_flag(name, PREFILL_GRAPH_BACKEND):
                backend = value
            elif _is_flag(name, GRAPH_CONFIG):
                try:
                    phase = json.loads(value).get("prefill")
                except (ValueError, AttributeError):
                    out.append(
                        f"{where}: {name} {value!r} is not a JSON object, so whether it "
                        f"turns SGLang's "
                        f"prefill CUDA graph on (and capture off) cannot be told; {fix}"
                    )
                    continue
                backend = (
                    phase.get("backend", "disabled") if isinstance(phase, dict) else "disabled"
                )
            else:
                continue
            if backend != "disabled":
                out.append(
                    f"{where}: {name} {value} sets SGLang's prefill CUDA graph backend to "
                    f"{backend!r}, over the "
                    f"capture launch's --disable-prefill-cuda-graph; eyas's dump hook (and "
                    f"a source-patched "
                    f"model) run only in eager forwards, so graph-replayed prefills would "
                    f"write no dump records and every extraction request would time out; {fix}"
                )
    return out
