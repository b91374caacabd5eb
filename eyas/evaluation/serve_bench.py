"""The serving stage: acceptance length and speed-up of the drafter, measured by serving it.

    result = run_serve_bench(cfg, drafter_dir, {"heldout": {"prompts": ids, "source": {...}}, ...})
    result.chains["3/1/4"]["sets"]["heldout"]["acceptance_length"]   # per chain, per prompt set
    result.speedup["single_stream_tokens_per_s"]                      # > 1.0: the drafter pays off

Launches (eyas/evaluation/serving.py: the pipeline's own launch, readiness and stop code): the
target plainly, once; then once per chain with SGLang's EAGLE-3 flags and the drafter, the chains
being evaluation.draft_steps (k/1/k+1 each) and the benchmark's chain where it is none of those.
On every launch, after `num_warmup` requests:

- **acceptance**: every prompt set (the held-out prompts, then each of benchmark.suites) one prompt
  at a time, greedy, to the target's eos or evaluation.max_new_tokens. Per prompt and pooled:
  completion tokens / meta_info.spec_verify_ct (eyas/evaluation/acceptance.py), the output compared
  token by token with the plain launch's, and the pass's output tokens/s, whose ratio to the plain
  pass on the same prompts is that set's speed-up (equal work wherever the outputs are equal);
- **speed** (on the plain launch and the benchmark chain's, when benchmark.enabled): `num_repeats`
  passes of the benchmark's settings over the first benchmark.num_prompts held-out prompts: single
  stream output tokens/s, `concurrency` requests in flight, time to first token (a max_new_tokens=1
  request: prefill plus a token); medians over the passes.

With `interleave` (small targets on a shared machine) the plain server stays up while each chain's
server is up beside it (port + 1), and their passes alternate, so a change in the machine's load
hits both alike; otherwise one server at a time, plain first. With `concurrent` as well, the two
passes run at the same time instead (each server single-threaded on its own core, say: the
embedded default's 2 cores), which halves the stage where one server cannot use the machine; the
speed pass then runs phase by phase (Meter.PHASES), so neither server's single streams meet the
other's heavier concurrent phase.

With `reference_backend` (a real SGLang beside eyas's own server on this machine), the same launches
are made once more on eyas's server, acceptance only, and the result's `reference` sets its figures
beside SGLang's per chain and prompt set.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack, nullcontext
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path
from typing import Any, Protocol

from eyas.config import BenchmarkConfig, PipelineConfig
from eyas.errors import EyasError, InvalidInput
from eyas.evaluation.acceptance import pooled, prompt_record
from eyas.evaluation.serving import Chain, Meter, machine, running, serving_launch, stage_drafter
from eyas.server.hosts import Host, make_host
from eyas.server.launch import Launch, auth_headers


@dataclass(frozen=True)
class ServeBenchResult:
    """What the serving stage measured. It becomes JSON (dataclasses.asdict) only where it is
    written: <run_dir>/serve_bench.json and report.json's `serving`. Per chain and prompt set the
    figures are the nested mappings the JSON shows."""

    acceptance_length: float  # the headline chain's, on the held-out prompts
    headline_chain: str  # the first of evaluation.draft_steps, "k/1/k+1"
    chains: dict[
        str, dict
    ]  # per chain: its launch and, per prompt set, acceptance, speed-up, outputs
    identical_to_target: bool  # greedy outputs of every chain and set equal to the plain server's
    sets: dict[str, dict]  # per prompt set: its source and number of prompts
    plain: dict  # the plain launch, its per-set speed and (benchmark on) its speed passes
    benchmark_chain: str | None  # None: no speed figures (benchmark.enabled: false)
    drafter_dir: str
    seconds: float
    settings: dict  # the benchmark and evaluation settings, backend, target, server environment
    machine: dict
    speculative: dict | None = None  # the benchmark chain's launch and speed passes
    speedup: dict | None = None  # speculative over plain: single stream, concurrent, TTFT, per pass
    break_even_acceptance_length: float | None = None  # where this machine's round would break even
    identical_outputs: bool | None = (
        None  # the greedy speed passes' outputs (None: sampled, or no passes)
    )
    reference: dict | None = (
        None  # benchmark.reference_backend: the same drafter on eyas's server, per chain and set
    )


def heldout_prompts(cfg: PipelineConfig) -> list[list[int]]:
    """The evaluation prompts, prepared exactly as the pipeline's prepare stage does (no files
    written)."""
    from eyas.extraction import data
    from eyas.target import local_copy, target_dims, target_tokenizer

    _, vocab = target_dims(local_copy(cfg.target))
    records, skipped = data.load_records(
        cfg.data.path, vocab_size=vocab, bad_lines=cfg.data.bad_lines
    )
    return data.prepare(
        records, target_tokenizer(cfg), cfg.data, vocab_size=vocab, skipped=skipped
    ).heldout_prompts


def chains(cfg: PipelineConfig) -> tuple[list[Chain], Chain | None]:
    """(every chain served, the benchmark's chain or None when the speed figures are off)."""
    served = [Chain.of(k) for k in cfg.evaluation.draft_steps]
    b = cfg.benchmark
    bench = Chain(b.speculative_num_steps, b.speculative_eagle_topk, b.speculative_num_draft_tokens)
    if not b.enabled:
        return served, None
    return served + ([bench] if bench not in served else []), bench


def launches(cfg: PipelineConfig, drafter_dir: str | Path | None = None) -> list[Launch]:
    """Every launch of the stage, plain first (the stop hook stops each of them)."""
    offset = 1 if cfg.benchmark.interleave else 0
    own = [
        serving_launch(cfg, "plain", None),
        *(
            serving_launch(cfg, c.label, drafter_dir or "-", chain=c, port_offset=offset)
            for c in chains(cfg)[0]
        ),
    ]
    return own + (
        launches(reference_config(cfg), drafter_dir) if cfg.benchmark.reference_backend else []
    )


def reference_config(cfg: PipelineConfig) -> PipelineConfig:
    """The config of the reference launches: eyas's own server on the same target, drafter and
    chains, in its own workdir and ports, without SGLang's flags and environment, acceptance
    only."""
    s = cfg.server
    server = s.model_copy(
        update={
            "backend": cfg.benchmark.reference_backend,
            "python": None,
            "env": {},
            "launch_args": [],
            "capture_launch_args": [],
            "port": s.port + 2,
            "workdir": Path(s.workdir) / "reference",
            "dump_dir": Path(s.workdir) / "reference" / "dump",
        }
    )
    bench = cfg.benchmark.model_copy(
        update={
            "enabled": False,
            "reference_backend": None,
            "interleave": False,
            "launch_args": [],
            "speculative_launch_args": [],
            "server_env": {},
        }
    )
    return cfg.model_copy(update={"server": server, "benchmark": bench})


# ---------------------------------------------------------------------------------------------
# The launches: one at a time, or each chain beside the plain server
# ---------------------------------------------------------------------------------------------


class ServeProgress(Protocol):
    """Who watches the stage (tasks/progress.py's ServeBenchPublisher)."""

    def planned(self, prompts: dict[str, int]) -> None: ...

    def launched(self, key: str) -> None: ...

    def answered(
        self, key: str, what: str, done: int, total: int, acceptance: float | None
    ) -> None: ...


def _open(
    stack: ExitStack,
    host: Host,
    cfg: PipelineConfig,
    served: Launch,
    out: dict,
    key: str,
    warm: list[list[int]],
    log,
    owner,
    progress: ServeProgress | None = None,
) -> Meter:
    """Start `served` (stopped when the stack closes), warm up, and note the launch under out[key];
    tell `progress` that it is up, and then each prompt it answers."""
    launched_at = time.time()
    handle, ready_s = stack.enter_context(running(host, served, cfg.sensor, log, owner))
    window = {
        "launched_at": round(launched_at, 3),
        "ready_at": round(time.time(), 3),
    }  # when, in epoch seconds
    on_answer = partial(progress.answered, key) if progress is not None else None
    meter = Meter(handle.url, cfg.benchmark, auth_headers(served.server), on_answer)
    stack.callback(meter.close)
    meter.warm_up(warm)
    out[key] = {
        "command": handle.command,
        "ready_seconds": ready_s,
        **window,
        "sets": {},
        "speed": None,
    }
    if progress is not None:
        progress.launched(key)
    return meter


def _together(*calls):
    """Run the calls at the same time, one thread each -> their results in order (the first error
    raised)."""
    with ThreadPoolExecutor(len(calls)) as pool:
        return [f.result() for f in [pool.submit(c) for c in calls]]


def _speed(
    meters: list[Meter], prompts: list[list[int]], repeats: int, concurrent: bool = False
) -> list[dict]:
    for _ in range(repeats):  # two meters: their passes alternate, or run phase by phase together
        if concurrent:
            for phase in Meter.PHASES:
                _together(*(partial(m.phase, phase, prompts) for m in meters))
        else:
            for m in meters:
                m.one_pass(prompts)
    return [m.summary() for m in meters]


def _one_at_a_time(
    cfg: PipelineConfig,
    host: Host,
    sets: dict,
    speed_prompts: list[list[int]],
    planned: dict[str, Launch],
    bench: str | None,
    log,
    owner=None,
    progress: ServeProgress | None = None,
) -> dict[str, dict]:
    """Plain, then each chain: launch, every set, the speed passes (plain and bench), stop."""
    out: dict[str, dict] = {}
    for key, served in planned.items():
        with ExitStack() as stack:
            meter = _open(stack, host, cfg, served, out, key, speed_prompts, log, owner, progress)
            for name, s in sets.items():
                out[key]["sets"][name] = meter.serve_set(
                    s["prompts"], cfg.evaluation.max_new_tokens, name
                )
            if bench is not None and key in ("plain", bench):
                out[key]["speed"] = _speed([meter], speed_prompts, cfg.benchmark.num_repeats)[0]
    return out


def _serve_sets_beside(
    plain: Meter, spec: Meter, key: str, sets: dict, out: dict, max_new: int, together: bool
) -> None:
    """Every set on the chain's server into out[key], and on the plain one where it has not served
    it yet (the first chain's turn): their passes alternating, or at the same time."""
    for name, s in sets.items():
        calls = [partial(spec.serve_set, s["prompts"], max_new, name)]
        if name not in out["plain"]["sets"]:  # the first chain's turn
            calls.insert(0, partial(plain.serve_set, s["prompts"], max_new, name))
        results = _together(*calls) if together else [call() for call in calls]
        if len(results) == 2:
            out["plain"]["sets"][name] = results[0]
        out[key]["sets"][name] = results[-1]


def _interleaved(
    cfg: PipelineConfig,
    host: Host,
    sets: dict,
    speed_prompts: list[list[int]],
    planned: dict[str, Launch],
    bench: str | None,
    log,
    owner=None,
    progress: ServeProgress | None = None,
) -> dict[str, dict]:
    """The plain server up throughout; each chain's beside it in turn, their passes alternating (or,
    with benchmark.concurrent, running at the same time: each server on its own cores, and the plain
    and the first chain's servers launched at the same time too)."""
    out: dict[str, dict] = {}
    (_, plain_launch), *chain_launches = planned.items()
    together, max_new = cfg.benchmark.concurrent, cfg.evaluation.max_new_tokens

    def launch(stack: ExitStack, key: str, served: Launch) -> Meter:
        return _open(stack, host, cfg, served, out, key, speed_prompts, log, owner, progress)

    with ExitStack() as stack:
        # a chain's server, stopped after its turn
        inners = [stack.enter_context(ExitStack()) for _ in chain_launches]
        first = None
        if (
            together and chain_launches
        ):  # separate workdirs, ports and records: only the host shared
            plain, first = _together(
                partial(launch, stack, "plain", plain_launch),
                partial(launch, inners[0], *chain_launches[0]),
            )
        else:
            plain = launch(stack, "plain", plain_launch)
        for i, (key, served) in enumerate(chain_launches):
            with inners[i] as inner:
                spec = first if i == 0 and first is not None else launch(inner, key, served)
                _serve_sets_beside(plain, spec, key, sets, out, max_new, together)
                if key == bench:
                    out["plain"]["speed"], out[key]["speed"] = _speed(
                        [plain, spec], speed_prompts, cfg.benchmark.num_repeats, together
                    )
    return out


# ---------------------------------------------------------------------------------------------
# The stage: launches, then figures per chain and per set
# ---------------------------------------------------------------------------------------------


def _ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 3) if a and b else None


def _set_figures(sets: dict, spec: dict, plain: dict) -> dict[str, dict]:
    """Per set: pooled acceptance and per-prompt figures, equality with plain, tokens/s,
    speed-up."""
    figures = {}
    for name, s in sets.items():
        ran, ref = spec[name], plain[name]
        records = [
            prompt_record(len(p), out, v, reference=r)
            for p, out, v, r in zip(
                s["prompts"], ran["outputs"], ran["verify_steps"], ref["outputs"]
            )
        ]
        figures[name] = {
            **pooled(records),
            "tokens_per_s": ran["tokens_per_s"],
            "plain_tokens_per_s": ref["tokens_per_s"],
            "speedup": _ratio(ran["tokens_per_s"], ref["tokens_per_s"]),
        }
    return figures


def run_serve_bench(
    cfg: PipelineConfig,
    drafter_dir: str | Path,
    sets: dict[str, dict],
    host: Host | None = None,
    log=print,
    owner=None,
    progress: ServeProgress | None = None,
) -> ServeBenchResult:
    """Every launch, side by side -> per-chain acceptance per set, speed-up ratios, machine,
    settings.

    `sets` maps a name to {"prompts": token ids, "source": where they came from}; "heldout" (the
    data's held-out prompts) is required and cut to evaluation.num_prompts here. `owner`
    (ownership.Owner): who launches the servers, recorded with each launch. `progress`
    (ServeProgress) is told as each launch ("plain", "3/1/4", ...) is up and warmed, in the order
    of `launches`, and as it answers each prompt.
    """
    b, ev = cfg.benchmark, cfg.evaluation
    if not sets.get("heldout", {}).get("prompts"):
        raise InvalidInput("run_serve_bench: no held-out prompts (the held-out set is empty)")
    speed_prompts = sets["heldout"]["prompts"][: b.num_prompts]
    sets = {
        **sets,
        "heldout": {**sets["heldout"], "prompts": sets["heldout"]["prompts"][: ev.num_prompts]},
    }
    served, bench = chains(cfg)
    t0 = time.monotonic()
    # A host the caller passed stays open for the caller; one made here is closed here.
    with make_host(cfg.server.host) if host is None else nullcontext(host) as host:
        where = stage_drafter(host, cfg, drafter_dir)
        if str(where) != str(drafter_dir):
            log(f"drafter uploaded to {cfg.server.host.name}:{where}")
        planned = dict(zip(["plain", *(c.name for c in served)], launches(cfg, where)))
        if progress is not None:
            progress.planned(_prompts_per_launch(planned, sets, speed_prompts, bench, b))
        measure = _interleaved if b.interleave else _one_at_a_time
        runs = measure(
            cfg,
            host,
            sets,
            speed_prompts,
            planned,
            bench.name if bench else None,
            log,
            owner,
            progress,
        )
        reference = None
        if b.reference_backend:
            log(
                f"serving the same drafter on the reference backend ({b.reference_backend}) for "
                f"comparison"
            )
            reference = run_serve_bench(reference_config(cfg), drafter_dir, sets, host, log, owner)
    result = _assemble(
        cfg, drafter_dir, sets, len(speed_prompts), served, bench, runs, time.monotonic() - t0
    )
    return result if reference is None else replace(result, reference=compare(result, reference))


def _prompts_per_launch(
    keys, sets: dict, speed_prompts: list, bench: Chain | None, b: BenchmarkConfig
) -> dict[str, int]:
    """The prompts each launch answers one at a time: every set, and the speed passes' single
    streams on the plain server and the benchmarked chain (one at a time or side by side alike)."""
    per_set = sum(len(s["prompts"]) for s in sets.values())
    timed = ("plain", bench.name) if bench is not None else ()
    speed = len(speed_prompts) * b.num_repeats
    return {key: per_set + (speed if key in timed else 0) for key in keys}


def compare(result: ServeBenchResult, reference: ServeBenchResult) -> dict:
    """The reference server's acceptance beside this result's, per chain and prompt set, with
    relative_difference = reference / this - 1."""
    chains_ = {
        chain: {
            name: {
                "acceptance_length": r["acceptance_length"],
                "served_acceptance_length": c["sets"][name]["acceptance_length"],
                "relative_difference": _relative(
                    r["acceptance_length"], c["sets"][name]["acceptance_length"]
                ),
                "identical_to_target": r["identical_to_target"],
                "per_prompt": [p["acceptance_length"] for p in r["per_prompt"]],
            }
            for name, r in reference.chains[chain]["sets"].items()
        }
        for chain, c in result.chains.items()
    }
    return {
        "backend": reference.settings["backend"],
        "seconds": reference.seconds,
        "chains": chains_,
        "largest_relative_difference": max(
            abs(x["relative_difference"]) for c in chains_.values() for x in c.values()
        ),
    }


def _relative(a: float, b: float) -> float:
    return round(a / b - 1, 4)


def _assemble(
    cfg, drafter_dir, sets, num_speed_prompts, served, bench, runs, seconds
) -> ServeBenchResult:
    b, plain = cfg.benchmark, runs["plain"]
    result_chains = {
        c.name: {
            **_launch(runs[c.name]),
            "sets": _set_figures(sets, runs[c.name]["sets"], plain["sets"]),
        }
        for c in served
    }
    headline = result_chains[served[0].name]["sets"]["heldout"]
    plain_out = {
        **_launch(plain),
        "sets": {
            n: {k: r[k] for k in ("tokens_per_s", "seconds")} for n, r in plain["sets"].items()
        },
    }
    speed = {}
    if bench is not None:
        speed = _speed_figures(plain["speed"], runs[bench.name], b.temperature)
        plain_out.update(plain["speed"])
    return ServeBenchResult(
        acceptance_length=headline["acceptance_length"],  # the first chain's, held-out prompts
        headline_chain=served[0].name,
        chains=result_chains,
        # Greedy outputs of every chain and set equal to the plain server's (None counts: nothing
        # compared).
        identical_to_target=all(
            s["identical_to_target"] is not False
            for c in result_chains.values()
            for s in c["sets"].values()
        ),
        sets={
            name: {"source": s.get("source"), "num_prompts": len(s["prompts"])}
            for name, s in sets.items()
        },
        plain=plain_out,
        benchmark_chain=bench.name if bench else None,
        drafter_dir=str(drafter_dir),
        seconds=round(seconds, 1),
        settings={
            **b.model_dump(mode="json"),
            "num_prompts": num_speed_prompts,
            "evaluation": cfg.evaluation.model_dump(mode="json", exclude={"device"}),
            "backend": cfg.server.backend,
            "target": str(cfg.target.checkpoint),
            "server_env": {**cfg.server.env, **b.server_env},
        },
        machine=machine() if cfg.server.host.kind == "local" else {"host": cfg.server.host.name},
        **speed,
    )


def _launch(run: dict) -> dict[str, Any]:
    """What the report keeps of a launch: its command, seconds to ready, and when it started and was
    ready."""
    return {k: run[k] for k in ("command", "ready_seconds", "launched_at", "ready_at")}


def _speed_figures(plain: dict, spec_run: dict, temperature: float) -> dict[str, Any]:
    spec = {**spec_run["speed"], **_launch(spec_run)}
    identical = plain.pop("outputs") == spec.pop("outputs")
    speedup = {
        k: _ratio(spec[k], plain[k])
        for k in ("single_stream_tokens_per_s", "concurrent_tokens_per_s")
    }
    speedup["ttft"] = _ratio(plain["ttft_s"], spec["ttft_s"])  # > 1: the drafter made it faster
    # Interleaved passes ran at the same moment's load: their pairwise ratios are the cleaner
    # figure.
    speedup["single_stream_per_pass"] = [
        _ratio(x, y) for x, y in zip(spec["single_stream_runs"], plain["single_stream_runs"])
    ]
    al, ratio = spec["acceptance_length"], speedup["single_stream_tokens_per_s"]
    return {
        "speculative": spec,
        "speedup": speedup,
        # The acceptance length at which this machine's verify-plus-draft round would break even:
        # tokens/s scale with AL at a fixed cost per round, so AL / speed-up.
        "break_even_acceptance_length": round(al / ratio, 3) if al and ratio else None,
        # Greedy outputs must match token for token; sampled ones need not.
        "identical_outputs": identical if temperature == 0 else None,
    }


class OutputMismatch(EyasError, RuntimeError):
    """Speculative serving changed a greedy output on a deterministic backend (eyas-local): a
    bug."""


def check_outputs(cfg: PipelineConfig, result: ServeBenchResult) -> None:
    """On eyas-local, greedy outputs with the drafter must equal the plain server's, token for
    token.

    SGLang's are recorded, never enforced: its batched, speculative and CUDA-graph kernels may
    legitimately round differently and flip a near-tie (docs/operations.md).
    """
    if cfg.server.backend != "local":
        return
    bad = [
        f"{chain} on {name}: prompt(s) "
        f"{[i for i, p in enumerate(s['per_prompt']) if p['identical'] is False]}"
        for chain, c in result.chains.items()
        for name, s in c["sets"].items()
        if s["identical_to_target"] is False
    ]
    if bad or result.identical_outputs is False:
        raise OutputMismatch(
            "speculative decoding changed greedy outputs on eyas-local: "
            + ("; ".join(bad) or "the speed passes' outputs differ")
        )


# ---------------------------------------------------------------------------------------------
# Summaries: per prompt set (report.json's `benchmarks`) and the Prefect artifact
# ---------------------------------------------------------------------------------------------


def benchmarks(result: ServeBenchResult) -> dict[str, dict]:
    """Per prompt set: its source and, per chain, acceptance length, speed-up, output equality."""
    return {
        name: {
            **s,
            "chains": {
                chain: {
                    k: c["sets"][name][k]
                    for k in ("acceptance_length", "speedup", "identical_to_target")
                }
                for chain, c in result.chains.items()
            },
        }
        for name, s in result.sets.items()
    }


def _source(source: dict | None) -> str:
    if not source:
        return "-"
    if "package" in source:
        return f"{source['package']} {source['version']} (sha256 {source['sha256'][:12]})"
    return str(source.get("file", "-"))


def benchmarks_markdown(per_set: dict[str, dict]) -> str:
    """One row per prompt set: acceptance length and speed-up at each chain."""
    names = list(next(iter(per_set.values()))["chains"])
    head = (
        "| prompt set | source | prompts | "
        + " | ".join(f"AL {n} | speed-up {n}" for n in names)
        + " |"
    )
    rule = "|---|---|---|" + "---|---|" * len(names)
    rows = [
        f"| {name} | {_source(s['source'])} | {s['num_prompts']} | "
        + " | ".join(
            f"{s['chains'][n]['acceptance_length']:.3f} | {s['chains'][n]['speedup']}x"
            for n in names
        )
        + " |"
        for name, s in per_set.items()
    ]
    return "\n".join([head, rule, *rows]) + "\n"


def reference_markdown(reference: dict) -> str:
    """The same drafter served by the reference backend: acceptance beside the served one."""
    rows = [
        f"| {chain} | {name} | {x['served_acceptance_length']:.3f} | "
        f"{x['acceptance_length']:.3f} | {x['relative_difference']:+.1%} |"
        for chain, sets in reference["chains"].items()
        for name, x in sets.items()
    ]
    return (
        f"## The same drafter on {reference['backend']}\n\n| chain | prompt set | acceptance "
        f"served | acceptance on {reference['backend']} | difference "
        f"|\n|---|---|---|---|---|\n" + "\n".join(rows) + "\n"
    )


def markdown(result: ServeBenchResult) -> str:
    """The Prefect artifact: acceptance per chain and set, then plain vs speculative speed."""
    b = result.settings
    text = (
        f"# Serving with the drafter\n\n**Acceptance length {result.acceptance_length:.3f}** at "
        f"{result.headline_chain} on the held-out prompts (served; outputs identical to plain "
        f"serving: {result.identical_to_target})\n\n{benchmarks_markdown(benchmarks(result))}\n"
        f"Acceptance: each prompt alone, greedy, up to {b['evaluation']['max_new_tokens']} new "
        f"tokens; speed-up: that pass's output tokens/s over the plain server's.\n"
    )
    if result.reference:
        text += "\n" + reference_markdown(result.reference)
    if result.speedup is None:
        return text
    p, s, r = result.plain, result.speculative, result.speedup
    rows = [
        (
            "single-stream output tokens/s",
            "single_stream_tokens_per_s",
            r["single_stream_tokens_per_s"],
        ),
        (
            f"output tokens/s at concurrency {b['concurrency']}",
            "concurrent_tokens_per_s",
            r["concurrent_tokens_per_s"],
        ),
        ("time to first token (s)", "ttft_s", r["ttft"]),
    ]
    table = "\n".join(f"| {name} | {p[k]} | {s[k]} | {ratio} |" for name, k, ratio in rows)
    return (
        f"{text}\n## Speed at {result.benchmark_chain}\n\n"
        f"**Single-stream speed-up: {r['single_stream_tokens_per_s']}x**, acceptance length "
        f"{s['acceptance_length']}, outputs identical: {result.identical_outputs}\n\n"
        f"| figure | plain | with drafter | ratio |\n|---|---|---|---|\n{table}\n\n"
        f"{b['num_prompts']} prompts, {b['max_new_tokens']} new tokens, temperature "
        f"{b['temperature']}, "
        f"medians of {b['num_repeats']} passes after {b['num_warmup']} warm-up requests; "
        f"machine: {result.machine}\n"
    )
