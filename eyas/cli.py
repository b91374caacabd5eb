"""The eyas command line's core commands (Prefect-free); `python -m eyas` runs them.

    eyas check-config CONFIG [--set k=v ...]             validate a config and print it resolved
    eyas preflight CONFIG [--set k=v ...] [--no-hosts]   check what needs no GPU; print the plan
    eyas serve-local --model-path P --port N [...]       the SGLang-compatible local target server
    eyas make-tiny-target OUT [--steps N --device D]     rebuild the embedded tiny target
    eyas stop CONFIG                                     stop a server the config launched

The `eyas` script (flows/runtime/cli.py) adds `eyas run`, which runs the pipeline as a Prefect flow,
through `main(argv, extra=...)`, and hands every other command to this module. Each subcommand is a
thin shell over one core function; the config file carries the settings.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

from eyas.threads import apply_cpu_settings


@dataclass(frozen=True)
class Command:
    """A subcommand that takes a CONFIG and `--set key=value` overrides; `run(args) -> exit
    code`."""

    name: str
    help: str
    run: Callable[[argparse.Namespace], int]
    arguments: Callable[[argparse.ArgumentParser], None] | None = None  # its own flags


def load(args: argparse.Namespace):
    """args.config with args.set applied, validated; a bad one exits naming the file, field and
    value."""
    from eyas.config import ConfigError, load_config
    from eyas.config.loading import parse_overrides

    try:
        return load_config(args.config, parse_overrides(args.set))
    except ConfigError as e:
        raise SystemExit(str(e)) from None


def cmd_check_config(args) -> int:
    print(load(args).model_dump_json(indent=2))
    return 0


def cmd_preflight(args) -> int:
    from eyas.preflight import format_preflight, preflight

    cfg = load(args)
    result = preflight(cfg, check_hosts=not args.no_hosts, check_tokenizer=not args.no_tokenizer)
    print(format_preflight(result, cfg))
    return 0 if result.ok else 1


def _preflight_arguments(sp: argparse.ArgumentParser) -> None:
    sp.add_argument(
        "--no-hosts", action="store_true", help="skip the SSH and SGLang version checks"
    )
    sp.add_argument(
        "--no-tokenizer",
        action="store_true",
        help="do not load the tokenizer (its files and chat template are still checked)",
    )


def cmd_stop(args) -> int:
    from eyas.server.hosts import make_host
    from eyas.server.launch import capture_launch, stop_recorded

    cfg = load(args)  # only a server this config's launch recorded, and still that very process
    with make_host(cfg.server.host) as host:
        print(json.dumps(stop_recorded(host, capture_launch(cfg))))
    return 0


def cmd_make_tiny_target(args) -> int:
    from eyas.local.tiny_target import build_tiny_target

    metrics = build_tiny_target(
        Path(args.out), steps=args.steps, device=args.device, seed=args.seed
    )
    print(json.dumps(metrics, indent=2))
    return 0


COMMANDS = (
    Command("check-config", "validate and print a config", cmd_check_config),
    Command(
        "preflight",
        "check a config before any GPU is used; print the plan",
        cmd_preflight,
        _preflight_arguments,
    ),
    Command("stop", "stop the server a config launched", cmd_stop),
)


def main(argv: list[str] | None = None, extra: Sequence[Command] = ()) -> int:
    """Parse argv and run its command; `extra` are commands a layer above adds (the `eyas` script's
    `run`)."""
    argv = sys.argv[1:] if argv is None else argv
    chose = apply_cpu_settings()  # before torch loads: OpenMP reads its wait policy once
    if chose:
        print(f"eyas: {chose}", file=sys.stderr)
    if argv and argv[0] == "serve-local":
        from eyas.local.server import main as serve_local

        return serve_local(argv[1:])
    p = argparse.ArgumentParser(
        prog="eyas", description="Raise EAGLE-3 drafters for SGLang targets."
    )
    sub = p.add_subparsers(dest="command", required=True)
    for c in (*extra, *COMMANDS):
        sp = sub.add_parser(c.name, help=c.help)
        sp.add_argument("config")
        sp.add_argument(
            "--set",
            action="append",
            default=[],
            metavar="KEY=VALUE",
            help="override a config field, e.g. training.max_steps=50",
        )
        if c.arguments:
            c.arguments(sp)
        sp.set_defaults(fn=c.run)
    sp = sub.add_parser("make-tiny-target", help="rebuild the embedded tiny target")
    sp.add_argument("out")
    sp.add_argument("--steps", type=int, default=3000)
    sp.add_argument("--device", default="auto")
    sp.add_argument("--seed", type=int, default=0)
    sp.set_defaults(fn=cmd_make_tiny_target)
    sub.add_parser("serve-local", help="the SGLang-compatible local target server (see --help)")
    if argv and argv[0] == "run" and not any(c.name == "run" for c in extra):
        raise SystemExit(
            "eyas: `run` starts Prefect flows: use the `eyas` script "
            "(or python -m eyas_prefect.flows.runtime.cli run CONFIG)"
        )
    args = p.parse_args(argv)
    return args.fn(args)


if __name__ == "__main__":
    sys.exit(main())
