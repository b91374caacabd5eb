"""The eyas command line.

    eyas run CONFIG [--set training.max_steps=50 ...]   run the whole pipeline (a Prefect flow)
    eyas check-config CONFIG                             validate a config and print it resolved
    eyas preflight CONFIG [--set k=v ...] [--no-hosts]   check all a GPU is not needed for; print the plan
    eyas serve-local --model-path P --port N [...]       the SGLang-compatible local target server
    eyas make-tiny-target OUT [--steps N --device D]     rebuild the embedded tiny target
    eyas stop CONFIG                                     stop a server the config launched

Each subcommand is a thin shell over one core function; the config file carries the settings.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import yaml


def _overrides(pairs: list[str]) -> dict:
    out = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep:
            raise SystemExit(f"--set expects key=value, got {pair!r}")
        out[key] = yaml.safe_load(value)
    return out


def _load(args):
    from eyas.config import ConfigError, load_config

    try:
        return load_config(args.config, _overrides(args.set))
    except ConfigError as e:
        raise SystemExit(str(e)) from None


def cmd_run(args) -> int:
    # No Prefect telemetry from eyas's own process (read when prefect is first imported, below)
    # unless the operator asks for it: offline it only printed tracebacks that looked like eyas failing.
    os.environ.setdefault("DO_NOT_TRACK", "1")
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    cfg = _load(args)
    from flows.pipeline import eagle3_pipeline
    from flows.process import run_in_process

    # SIGTERM / SIGINT: the run's servers stopped, its flow runs final, exit within seconds.
    state = run_in_process(eagle3_pipeline, cfg, return_state=True)
    if not state.is_completed():  # the reason was logged once, as `failed at TASK: reason`: no traceback
        from flows.failures import printed

        raise SystemExit(f"eyas: run {state.name}" + (f": {state.message}" if not printed(state.message or "")
                                                      else f" ({(state.message or '').split(': ', 1)[0]})"))
    report = state.result()
    per_set = {name: {chain: c["acceptance_length"] for chain, c in s["chains"].items()}
               for name, s in (report["benchmarks"] or {}).items()}  # acceptance per prompt set and chain
    print(json.dumps({**{k: report[k] for k in ("acceptance_length", "speedup", "extraction", "stages_seconds")},
                      "acceptance_per_set": per_set}, indent=2))
    print(f"report:  {Path(cfg.run_dir) / 'report.json'}")
    print(f"drafter: {report['drafter_dir']}")
    return 0


def cmd_check_config(args) -> int:
    print(_load(args).model_dump_json(indent=2))
    return 0


def cmd_preflight(args) -> int:
    from eyas.preflight import format_preflight, preflight

    cfg = _load(args)
    result = preflight(cfg, check_hosts=not args.no_hosts, check_tokenizer=not args.no_tokenizer)
    print(format_preflight(result, cfg))
    return 0 if result.ok else 1


def cmd_stop(args) -> int:
    from eyas.server.hosts import make_host
    from eyas.server.launch import stop_server

    cfg = _load(args)  # only a server this config's launch recorded, and still that very process
    print(json.dumps(stop_server(make_host(cfg.server.host), cfg)))
    return 0


def cmd_make_tiny_target(args) -> int:
    from eyas.local.tiny_target import build_tiny_target

    metrics = build_tiny_target(Path(args.out), steps=args.steps, device=args.device, seed=args.seed)
    print(json.dumps(metrics, indent=2))
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "serve-local":
        from eyas.local.server import main as serve_local

        return serve_local(argv[1:])
    p = argparse.ArgumentParser(prog="eyas", description="Raise EAGLE-3 drafters for SGLang targets.")
    sub = p.add_subparsers(dest="command", required=True)
    for name, fn, help_ in [("run", cmd_run, "run the whole pipeline"),
                            ("check-config", cmd_check_config, "validate and print a config"),
                            ("preflight", cmd_preflight, "check a config before any GPU is used; print the plan"),
                            ("stop", cmd_stop, "stop the server a config launched")]:
        sp = sub.add_parser(name, help=help_)
        sp.add_argument("config")
        sp.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="override a config field, e.g. training.max_steps=50")
        if name == "preflight":
            sp.add_argument("--no-hosts", action="store_true", help="skip the SSH and SGLang version checks")
            sp.add_argument("--no-tokenizer", action="store_true",
                            help="do not load the tokenizer (its files and chat template are still checked)")
        sp.set_defaults(fn=fn)
    sp = sub.add_parser("make-tiny-target", help="rebuild the embedded tiny target")
    sp.add_argument("out")
    sp.add_argument("--steps", type=int, default=3000)
    sp.add_argument("--device", default="auto")
    sp.add_argument("--seed", type=int, default=0)
    sp.set_defaults(fn=cmd_make_tiny_target)
    sub.add_parser("serve-local", help="the SGLang-compatible local target server (see --help)")
    args = p.parse_args(argv)
    return args.fn(args)


if __name__ == "__main__":
    sys.exit(main())
