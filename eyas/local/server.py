"""eyas's local target server: a CPU stand-in for SGLang that speaks its HTTP API and its log lines.

    EYAS_DUMP_DIR=/tmp/dump python -m eyas.local.server --model-path fixtures/tiny-target \\
        --port 30000 --enable-return-aux-hidden-states --speculative-algorithm EAGLE3 \\
        --return-aux-hidden-state-layer-ids 2 4 5 --chunked-prefill-size 64 --disable-radix-cache

It loads a Hugging Face causal LM shard by shard (printing SGLang's loading bar), serves
/generate, /health, /health_generate, /ready, /model_info and /server_info, and, when
EYAS_DUMP_DIR is set and aux capture is on, writes every prefill chunk's hidden states through
eyas.dump, before the response is sent. It never reuses a prefix (no radix cache), so
meta_info.cached_tokens is always 0.

With a drafter it decodes greedy requests by chain speculative decoding, as SGLang does with
--speculative-algorithm EAGLE3 --speculative-draft-model-path DIR --speculative-num-steps 3
--speculative-eagle-topk 1 --speculative-num-draft-tokens 4; each response's meta_info carries
spec_verify_ct, and /server_info's internal_states[0].avg_spec_accept_length the running figure.

Fault flags make it fail the way SGLang does, for the readiness sensor's tests:
--fault {die,hang,oom}-at-shard --fault-shard K fires after K shards have loaded (bar at K/N).

This module is the HTTP side; its flags are parsed in arguments.py, a /generate body in
generate_request.py, and the model runs in engine.py.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
import traceback
import urllib.request
import uuid
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Iterator

from eyas import __version__
from eyas.dump import DUMP_DIR_ENV, DumpWriter, dtype_from_env
from eyas.local.arguments import parse_args
from eyas.local.engine import (
    BadRequest,
    Engine,
    Speculative,
    load_model,
    log,
    optional_tokenizer,
    resolve_capture_ids,
    set_dp_rank,
)
from eyas.local.generate_request import parse_generate, parse_sampling
from eyas.local.replicas import Worker, exit_with_parent, start_workers, wait_ready
from eyas.server.launcher import exit_with_launcher
from eyas.server.readiness import READY_LINE

# A request body larger than this is refused (413) before it is read: 64 MiB is some 5 million
# token ids as JSON, far beyond any batch eyas sends.
MAX_BODY_BYTES = 64 << 20


class ServerState:
    def __init__(
        self,
        engine: Engine,
        args: argparse.Namespace,
        model_info: dict,
        server_info: dict,
        workers: list[Worker] | None = None,
    ):
        self.engine, self.args = engine, args
        self.model_info, self.server_info = model_info, server_info
        self.up = False  # SGLang's ServerStatus.Up: set after the warmup request
        self.workers = workers or []  # --dp-size: the other replicas (eyas/local/replicas.py)
        self._in_flight = [0] * (1 + len(self.workers))
        self._lock = threading.Lock()

    @contextmanager
    def replica(self) -> Iterator[Worker | None]:
        """The replica with the fewest requests in flight for one /generate call (None: this
        process's engine), as SGLang's data-parallel controller dispatches to the shortest queue."""
        with self._lock:
            i = min(range(len(self._in_flight)), key=self._in_flight.__getitem__)
            self._in_flight[i] += 1
        try:
            yield None if i == 0 else self.workers[i - 1]
        finally:
            with self._lock:
                self._in_flight[i] -= 1


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, as uvicorn
    server_version = "eyas-local"

    @property
    def state(self) -> ServerState:
        return self.server.state  # type: ignore[attr-defined]

    def log_message(self, fmt: str, *args: Any) -> None:
        pass  # replaced by the uvicorn-style access line in _send

    def _auth(self) -> dict[str, str]:
        """The request's Authorization header, for a worker replica (which checks the key too)."""
        value = self.headers.get("Authorization")
        return {"Authorization": value} if value else {}

    def _send(
        self, status: int, payload: Any = None, *, close: bool = False, raw: bytes | None = None
    ) -> None:
        body = raw if raw is not None else b"" if payload is None else json.dumps(payload).encode()
        # Logged before sending, so a client's next log line (the warmup's ready line) comes after.
        host, port = self.client_address[:2]
        reason = self.responses.get(status, ("",))[0]
        log(f'INFO:     {host}:{port} - "{self.requestline}" {status} {reason}')
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        if close:  # the request's body was not read: the rest of the stream cannot be framed
            self.send_header("Connection", "close")
            self.close_connection = True
        self.end_headers()
        self.wfile.write(body)

    def _refused(self, path: str) -> bool:
        """SGLang's API-key middleware: /health* is open, every other route wants the bearer key."""
        key = self.state.args.api_key
        if (
            key is None
            or path.startswith("/health")
            or self.headers.get("Authorization") == f"Bearer {key}"
        ):
            return False
        self._send(401, {"error": "Unauthorized"})
        return True

    def do_GET(self) -> None:
        path = self.path.split("?", 1)[0]
        if self._refused(path):
            return None
        if path in ("/health", "/health_generate"):
            return self._health()
        if path == "/ready":
            return self._send(200 if self.state.up else 503)
        if path in ("/model_info", "/get_model_info"):
            return self._send(200, self.state.model_info)
        if path in (
            "/server_info",
            "/get_server_info",
        ):  # one internal state per DP replica, as SGLang
            engine = self.state.engine
            internal = [
                {
                    "avg_spec_accept_length": engine.avg_spec_accept_length(),
                    "num_completion_tokens": engine.num_completion_tokens,
                    "spec_verify_ct": engine.num_verify_steps,
                }
            ]
            for w in self.state.workers:
                internal += json.loads(w.forward("GET", path, headers=self._auth())[1])[
                    "internal_states"
                ]
            return self._send(200, {**self.state.server_info, "internal_states": internal})
        if path == "/flush_cache":
            return self._send(200)
        self._send(404, {"error": f"no route GET {path}"})

    def _body_length(self) -> int | None:
        """The body's length from Content-Length, or None once a 4xx has been sent (and the
        connection marked to close): a bad or huge length must not make a thread wait for bytes."""
        values = [v.strip() for v in self.headers.get_all("Content-Length") or []]
        if "chunked" in (self.headers.get("Transfer-Encoding") or "").lower():
            self._send(
                411,
                {"error": "chunked bodies are not supported: send the body with a Content-Length"},
                close=True,
            )
        elif len(set(values)) > 1:
            self._send(400, {"error": f"conflicting Content-Length headers {values}"}, close=True)
        elif values and not (values[0].isascii() and values[0].isdigit()):
            self._send(
                400, {"error": f"Content-Length {values[0][:40]!r} is not a byte count"}, close=True
            )
        elif values and (len(values[0]) > 12 or int(values[0]) > MAX_BODY_BYTES):
            self._send(
                413,
                {
                    "error": f"the request body may have at most {MAX_BODY_BYTES} bytes, "
                    f"Content-Length says {values[0][:40]}"
                },
                close=True,
            )
        else:
            return int(values[0]) if values else 0
        return None

    def do_POST(self) -> None:
        path = self.path.split("?", 1)[0]
        length = self._body_length()
        if length is None:
            return
        raw = self.rfile.read(length)
        if self._refused(path):
            return None
        if path == "/flush_cache":
            return self._send(200)
        if path != "/generate":
            return self._send(404, {"error": f"no route POST {path}"})
        try:
            body = json.loads(raw or b"null")
        except json.JSONDecodeError as e:
            return self._send(400, {"error": f"the request body is not valid JSON: {e}"})
        engine = self.state.engine
        try:
            reqs, batched = parse_generate(body, engine.vocab_size, engine.tokenizer)
            with self.state.replica() as worker:
                if worker is not None:  # checked here, answered there: the worker's reply as it is
                    status, reply = worker.forward(
                        "POST", path, raw, {"Content-Type": "application/json", **self._auth()}
                    )
                    return self._send(status, raw=reply)
                results = [engine.generate(ids, rid, params) for ids, rid, params in reqs]
        except BadRequest as e:
            return self._send(400, {"error": str(e)})
        except Exception as e:  # noqa: BLE001 - reported to the client and logged, server stays up
            log(f"Error in /generate: {traceback.format_exc()}")
            return self._send(500, {"error": f"{type(e).__name__}: {e}"})
        self._send(200, results if batched else results[0])

    def _health(self) -> None:
        # SGLang's /health runs a 1-token generate on token 0 with rid HEALTH_CHECK_<time>.
        if not self.state.up:
            return self._send(503)
        params = parse_sampling({"max_new_tokens": 1, "temperature": 0}, "health")
        try:
            self.state.engine.generate([0], f"HEALTH_CHECK_{time.time()}", params)
        except Exception:  # noqa: BLE001
            log(f"Health check failed. {traceback.format_exc()}")
            return self._send(503)
        self._send(200)


def _warmup_then_ready(state: ServerState, url: str, skip_warmup: bool) -> None:
    """SGLang's _wait_and_warmup: one real request over HTTP, then the ready line."""
    if not skip_warmup:
        body = {
            "sampling_params": {"temperature": 0, "max_new_tokens": 8},
            "rid": f"WARMUP_{uuid.uuid4().hex}",
        }
        if state.engine.tokenizer is not None:
            body["text"] = "The capital city of France is"
        else:
            body["input_ids"] = [i % state.engine.vocab_size for i in (10, 11, 12)]
        try:
            key = state.args.api_key
            req = urllib.request.Request(
                f"{url}/generate",
                data=json.dumps(body).encode(),
                headers={
                    "Content-Type": "application/json",
                    **({"Authorization": f"Bearer {key}"} if key else {}),
                },
            )
            with urllib.request.urlopen(req, timeout=600) as res:
                res.read()
        except Exception:  # noqa: BLE001 - any failure means the server is not usable
            log(f"Initialization failed. warmup error: {traceback.format_exc()}")
            os._exit(1)
    state.up = True
    log(READY_LINE)


class _HTTPServer(ThreadingHTTPServer):
    # socketserver listens with a backlog of 5, SGLang's uvicorn with 2048: with tens of requests in
    # flight (regeneration keeps 32, several clients share a server) a full accept queue drops their
    # connections' SYNs, each then retried a second or more later by the client's kernel
    request_queue_size = 2048
    daemon_threads = True


def _dump_writer(args, capture_ids: list[int]) -> DumpWriter | None:
    """Hidden-state capture: dump only when asked for on the command line and given a folder."""
    dump_dir = os.environ.get(DUMP_DIR_ENV)
    if args.enable_return_aux_hidden_states and dump_dir:
        writer = DumpWriter(dump_dir, layer_ids=capture_ids, dtype=dtype_from_env())
        log(f"Dumping aux hidden states of layers {capture_ids} to {dump_dir} ({writer.dtype})")
        return writer
    if dump_dir:
        log(f"{DUMP_DIR_ENV} is set but --enable-return-aux-hidden-states is not: no dump")
    return None


def _infos(
    args, shown: dict, model, engine, writer: DumpWriter | None, capture_ids: list[int]
) -> tuple[dict, dict]:
    """(/model_info, /server_info) as SGLang answers them, with eyas-local's capture settings."""
    served = args.served_model_name or args.model_path
    model_info = {
        "model_path": args.model_path,
        "tokenizer_path": args.model_path,
        "served_model_name": served,
        "is_generation": True,
        "architectures": list(model.config.architectures or [type(model).__name__]),
        "model_type": model.config.model_type,
        "weight_version": "default",
        "preferred_sampling_params": None,
        "has_image_understanding": False,
        "has_audio_understanding": False,
    }
    server_info = {
        **shown,
        "served_model_name": served,
        "version": __version__,
        "backend": "eyas-local",
        "dump_dir": os.environ.get(DUMP_DIR_ENV) if writer else None,
        "aux_hidden_state_layer_ids": capture_ids if writer else None,
        "layer_convention": "capture-before",
        "hidden_size": model.config.hidden_size,
        "num_hidden_layers": model.config.num_hidden_layers,
        "vocab_size": model.config.vocab_size,
        "context_length": engine.context_len,
        "internal_states": [{}],
    }
    return model_info, server_info


def _log_args(args) -> dict:
    """Log the arguments as SGLang does (the API key hidden) and the ones eyas-local ignores ->
    the arguments as shown."""
    shown = {**vars(args), "api_key": None if args.api_key is None else "***"}
    log(f"server_args={shown}")
    if args.tp_size != 1:
        log(f"tp_size={args.tp_size} ignored: eyas-local runs the whole model in one CPU process")
    if args.dtype not in ("auto", "float32"):
        log(f"dtype={args.dtype} ignored: eyas-local computes in float32 on CPU")
    return shown


def _engine(args, model, tokenizer, writer: DumpWriter | None, capture_ids: list[int]) -> Engine:
    """The engine over the loaded model, with the drafter where one is given."""
    speculative = None
    if args.speculative_draft_model_path is not None:
        speculative = Speculative.load(
            args.speculative_draft_model_path,
            args.model_path,
            num_steps=args.speculative_num_steps,
            num_target_layers=model.config.num_hidden_layers,
        )
    return Engine(
        model,
        tokenizer,
        chunk_size=args.chunked_prefill_size,
        writer=writer,
        capture_ids=capture_ids,
        seed=args.random_seed,
        speculative=speculative,
        max_running=args.max_running_requests,
        think_tokens=args.think_tokens,
    )


def main(argv: list[str] | None = None) -> int:
    raw_argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(raw_argv)
    if args.dp_worker:
        exit_with_parent()
    else:
        exit_with_launcher(log)
    if args.dp_size > 1 or args.dp_worker:  # each replica's lines say which (the front is DP0)
        set_dp_rank(args.dp_rank)
    shown = _log_args(args)

    # 1. Load the model (and fail here, as SGLang would, if a fault is injected)
    workers = []  # --dp-size: the other replicas, this server again as worker processes; they load
    if args.dp_size > 1:  # their models while this one loads its own
        log(f"dp_size={args.dp_size}: starting {args.dp_size - 1} more replica(s) of the model")
        workers = start_workers(raw_argv, args.dp_size - 1, log)
    model = load_model(
        args.model_path, load_delay=args.load_delay, fault=args.fault, fault_shard=args.fault_shard
    )
    tokenizer = optional_tokenizer(args.model_path)

    # 2. Hidden-state capture: dump only when asked for on the command line and given a folder
    num_layers = model.config.num_hidden_layers
    capture_ids = resolve_capture_ids(args.return_aux_hidden_state_layer_ids, num_layers)
    writer = _dump_writer(args, capture_ids)
    engine = _engine(args, model, tokenizer, writer, capture_ids)
    if workers:
        wait_ready(workers)
        log(
            f"dp_size={args.dp_size}: {args.dp_size} replicas ready (pids "
            f"{[w.proc.pid for w in workers]} "
            f"besides this one); each request goes to the least busy"
        )

    # 3. Serve, then warm up over HTTP and announce readiness
    model_info, server_info = _infos(args, shown, model, engine, writer, capture_ids)
    httpd = _HTTPServer((args.host, args.port), Handler)
    httpd.state = ServerState(engine, args, model_info, server_info, workers)  # type: ignore[attr-defined]
    url = f"http://{args.host}:{args.port}"
    log(f"INFO:     Uvicorn running on {url} (Press CTRL+C to quit)")
    threading.Thread(
        target=_warmup_then_ready, args=(httpd.state, url, args.skip_server_warmup), daemon=True
    ).start()
    try:
        httpd.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        httpd.server_close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
