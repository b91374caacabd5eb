"""The local server's command line: sglang.launch_server's flags that eyas uses (the rest accepted
where SGLang users pass them), plus eyas's fault flags; every inconsistency refused by argparse."""

from __future__ import annotations

import argparse

from eyas.local.engine import FAULTS

DESCRIPTION = (
    "eyas's local target server: a CPU stand-in for SGLang that speaks its HTTP API and "
    "its log lines."
)


def _add_model_args(p: argparse.ArgumentParser) -> None:
    """What is served, and where."""
    p.add_argument(
        "--model-path", required=True, help="Hugging Face folder with config.json and shards"
    )
    p.add_argument("--served-model-name", default=None)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument(
        "--tp-size", "--tp", type=int, default=1, help="accepted; eyas-local runs one CPU process"
    )
    p.add_argument("--dtype", default="auto", help="accepted; eyas-local computes in float32")


def _add_capture_args(p: argparse.ArgumentParser) -> None:
    """The aux hidden states extraction reads."""
    p.add_argument("--enable-return-aux-hidden-states", action="store_true")
    p.add_argument(
        "--return-aux-hidden-state-layer-ids",
        type=int,
        nargs="+",
        default=None,
        help="capture-before ids: id i is the input of decoder layer i (HF hidden_states[i])",
    )


def _add_speculative_args(p: argparse.ArgumentParser) -> None:
    """Speculative decoding with an exported drafter."""
    p.add_argument(
        "--speculative-algorithm",
        default=None,
        help="EAGLE3; without a draft model path it only names the aux convention",
    )
    p.add_argument(
        "--speculative-draft-model-path",
        default=None,
        help="an exported EAGLE-3 drafter folder: greedy requests use speculative decoding",
    )
    p.add_argument(
        "--speculative-num-steps", type=int, default=3, help="draft tokens per verify step"
    )
    p.add_argument(
        "--speculative-eagle-topk", type=int, default=1, help="only 1 (a chain) is implemented"
    )
    p.add_argument(
        "--speculative-num-draft-tokens",
        type=int,
        default=None,
        help="with topk 1 it must be num-steps + 1 (the default)",
    )


def _add_scheduling_args(p: argparse.ArgumentParser) -> None:
    """Prefill chunks, requests decoded together, replicas."""
    p.add_argument(
        "--disable-radix-cache", action="store_true", help="accepted; there is no prefix cache"
    )
    p.add_argument(
        "--chunked-prefill-size",
        type=int,
        default=8192,
        help="tokens per prefill chunk; -1 = no chunking",
    )
    p.add_argument("--skip-server-warmup", action="store_true")
    p.add_argument(
        "--max-running-requests",
        type=int,
        default=1,
        help="plain (non-speculative) requests decoded together, one forward per step for all",
    )
    p.add_argument(
        "--dp-size",
        "--data-parallel-size",
        type=int,
        default=1,
        help="model replicas (SGLang's data-parallel workers): worker processes beside "
        "this "
        "one, each request to the replica with the fewest in flight",
    )
    p.add_argument(
        "--dp-worker", action="store_true", help=argparse.SUPPRESS
    )  # a replica --dp-size started
    p.add_argument("--dp-rank", type=int, default=0, help=argparse.SUPPRESS)  # that replica's index


def _add_other_args(p: argparse.ArgumentParser) -> None:
    """SGLang's other flags: the API key and seed, and those accepted but ignored."""
    p.add_argument(
        "--api-key",
        default=None,
        help="as SGLang: every route but /health* wants "
        "'Authorization: Bearer KEY' (never logged nor shown in /server_info)",
    )
    p.add_argument("--mem-fraction-static", type=float, default=None, help="accepted, ignored")
    p.add_argument("--trust-remote-code", action="store_true", help="accepted, ignored")
    p.add_argument(
        "--random-seed", type=int, default=0, help="seed of sampling without sampling_seed"
    )
    p.add_argument(
        "--log-level",
        default="info",
        help="accepted; eyas-local logs at info (the sensor reads those lines)",
    )


def _add_fault_args(p: argparse.ArgumentParser) -> None:
    """eyas-only realism and fault injection."""
    p.add_argument(
        "--load-delay", type=float, default=0.0, help="seconds of sleep per shard (a slow load)"
    )
    p.add_argument("--fault", choices=FAULTS, default="none")
    p.add_argument(
        "--fault-shard", type=int, default=0, help="the fault fires after this many shards loaded"
    )
    p.add_argument(
        "--think-tokens",
        type=int,
        default=0,
        help="play a thinking model: a reply "
        "inside the "
        "<think> its prompt opened reasons this many tokens, then </think> (0: off)",
    )


def parser() -> argparse.ArgumentParser:
    """The flags: SGLang's names, with eyas-local's meaning in each help text."""
    p = argparse.ArgumentParser(prog="eyas serve-local", description=DESCRIPTION)
    _add_model_args(p)
    _add_capture_args(p)
    _add_speculative_args(p)
    _add_scheduling_args(p)
    _add_other_args(p)
    _add_fault_args(p)
    return p


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = parser()
    args = p.parse_args(argv)
    if args.speculative_draft_model_path is not None:
        _check_speculative(p, args)
    if args.chunked_prefill_size == 0 or args.chunked_prefill_size < -1:
        p.error(f"--chunked-prefill-size must be positive or -1, got {args.chunked_prefill_size}")
    if args.max_running_requests < 1:
        p.error(f"--max-running-requests must be >= 1, got {args.max_running_requests}")
    if args.dp_size < 1:
        p.error(f"--dp-size must be >= 1, got {args.dp_size}")
    ids = args.return_aux_hidden_state_layer_ids
    if ids is not None and (len(set(ids)) != len(ids) or min(ids) < 0):
        p.error(f"--return-aux-hidden-state-layer-ids must be unique and non-negative, got {ids}")
    return args


def _check_speculative(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """A drafter's launch: EAGLE3, a chain, no aux capture; num-draft-tokens filled in."""
    if args.speculative_algorithm != "EAGLE3":
        p.error(
            f"--speculative-draft-model-path needs --speculative-algorithm EAGLE3, "
            f"got {args.speculative_algorithm!r}"
        )
    if args.enable_return_aux_hidden_states:
        p.error(
            "--enable-return-aux-hidden-states cannot be combined with "
            "--speculative-draft-model-path (SGLang refuses it too)"
        )
    if args.speculative_num_steps < 1:
        p.error(f"--speculative-num-steps must be >= 1, got {args.speculative_num_steps}")
    if args.speculative_eagle_topk != 1:
        p.error(
            f"--speculative-eagle-topk {args.speculative_eagle_topk}: eyas-local drafts a chain "
            f"(topk 1) only"
        )
    if args.speculative_num_draft_tokens is None:
        args.speculative_num_draft_tokens = args.speculative_num_steps + 1
    if args.speculative_num_draft_tokens != args.speculative_num_steps + 1:
        p.error(
            f"--speculative-num-draft-tokens must be num-steps + 1 = "
            f"{args.speculative_num_steps + 1} with topk 1, got {args.speculative_num_draft_tokens}"
        )
