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
from eyas.dump import DUMP_DIR_ENV, DumpWriter, check_rid, dtype_from_env
from eyas.server.readiness import READY_LINE
from eyas.local.engine import (FAULTS, BadRequest, Engine, Speculative, load_model,
                               optional_tokenizer, log, resolve_capture_ids)
from eyas.local.launcher import exit_with_launcher
from eyas.local.replicas import Worker, exit_with_parent, start_workers, wait_ready


# Sampling params SGLang accepts that eyas-local does not implement: allowed only at the value
# that means "off", so a client relying on them fails loudly instead of being silently ignored.
_NEUTRAL_SAMPLING = {"top_p": 1.0, "top_k": -1, "min_p": 0.0, "frequency_penalty": 0.0,
                     "presence_penalty": 0.0, "repetition_penalty": 1.0, "n": 1}
_SAMPLING_KEYS = {"max_new_tokens", "temperature", "sampling_seed", "ignore_eos", "stop_token_ids",
                  "skip_special_tokens", "spaces_between_special_tokens", "no_stop_trim",
                  *_NEUTRAL_SAMPLING}
# Top-level /generate fields accepted only when false/empty (eyas gets hidden states from the dump).
_FALSY_FIELDS = {"stream", "return_logprob", "return_hidden_states", "logprob_start_len",
                 "top_logprobs_num", "return_text_in_logprobs", "log_metrics", "lora_path",
                 "custom_logit_processor", "bootstrap_host", "bootstrap_room"}
_GENERATE_KEYS = {"input_ids", "text", "rid", "sampling_params", *_FALSY_FIELDS}
# A request body larger than this is refused (413) before it is read: 64 MiB is some 5 million
# token ids as JSON, far beyond any batch eyas sends.
MAX_BODY_BYTES = 64 << 20


# ---------------------------------------------------------------------------------------------
# Arguments (mirroring sglang.launch_server, plus eyas's fault flags)
# ---------------------------------------------------------------------------------------------

def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="eyas serve-local", description=__doc__.split("\n")[0])
    p.add_argument("--model-path", required=True, help="Hugging Face folder with config.json and shards")
    p.add_argument("--served-model-name", default=None)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--tp-size", "--tp", type=int, default=1, help="accepted; eyas-local runs one CPU process")
    p.add_argument("--dtype", default="auto", help="accepted; eyas-local computes in float32")
    p.add_argument("--enable-return-aux-hidden-states", action="store_true")
    p.add_argument("--return-aux-hidden-state-layer-ids", type=int, nargs="+", default=None,
                   help="capture-before ids: id i is the input of decoder layer i (HF hidden_states[i])")
    p.add_argument("--speculative-algorithm", default=None,
                   help="EAGLE3; without a draft model path it only names the aux convention")
    p.add_argument("--speculative-draft-model-path", default=None,
                   help="an exported EAGLE-3 drafter folder: greedy requests use speculative decoding")
    p.add_argument("--speculative-num-steps", type=int, default=3, help="draft tokens per verify step")
    p.add_argument("--speculative-eagle-topk", type=int, default=1, help="only 1 (a chain) is implemented")
    p.add_argument("--speculative-num-draft-tokens", type=int, default=None,
                   help="with topk 1 it must be num-steps + 1 (the default)")
    p.add_argument("--disable-radix-cache", action="store_true", help="accepted; there is no prefix cache")
    p.add_argument("--chunked-prefill-size", type=int, default=8192,
                   help="tokens per prefill chunk; -1 = no chunking")
    p.add_argument("--skip-server-warmup", action="store_true")
    p.add_argument("--max-running-requests", type=int, default=1,
                   help="plain (non-speculative) requests decoded together, one forward per step for all")
    p.add_argument("--dp-size", "--data-parallel-size", type=int, default=1,
                   help="model replicas (SGLang's data-parallel workers): worker processes beside this "
                        "one, each request to the replica with the fewest in flight")
    p.add_argument("--dp-worker", action="store_true", help=argparse.SUPPRESS)  # a replica --dp-size started
    p.add_argument("--api-key", default=None, help="as SGLang: every route but /health* wants "
                   "'Authorization: Bearer KEY' (never logged nor shown in /server_info)")
    p.add_argument("--mem-fraction-static", type=float, default=None, help="accepted, ignored")
    p.add_argument("--trust-remote-code", action="store_true", help="accepted, ignored")
    p.add_argument("--random-seed", type=int, default=0, help="seed of sampling without sampling_seed")
    p.add_argument("--log-level", default="info",
                   help="accepted; eyas-local logs at info (the sensor reads those lines)")
    # eyas-only realism and fault injection
    p.add_argument("--load-delay", type=float, default=0.0, help="seconds of sleep per shard (a slow load)")
    p.add_argument("--fault", choices=FAULTS, default="none")
    p.add_argument("--fault-shard", type=int, default=0, help="the fault fires after this many shards loaded")
    p.add_argument("--think-tokens", type=int, default=0, help="play a thinking model: a reply inside the "
                   "<think> its prompt opened reasons this many tokens, then </think> (0: off)")
    args = p.parse_args(argv)
    if args.chunked_prefill_size == 0 or args.chunked_prefill_size < -1:
        p.error(f"--chunked-prefill-size must be positive or -1, got {args.chunked_prefill_size}")
    if args.speculative_draft_model_path is not None:
        if args.speculative_algorithm != "EAGLE3":
            p.error(f"--speculative-draft-model-path needs --speculative-algorithm EAGLE3, "
                    f"got {args.speculative_algorithm!r}")
        if args.enable_return_aux_hidden_states:
            p.error("--enable-return-aux-hidden-states cannot be combined with "
                    "--speculative-draft-model-path (SGLang refuses it too)")
        if args.speculative_num_steps < 1:
            p.error(f"--speculative-num-steps must be >= 1, got {args.speculative_num_steps}")
        if args.speculative_eagle_topk != 1:
            p.error(f"--speculative-eagle-topk {args.speculative_eagle_topk}: eyas-local drafts a chain "
                    f"(topk 1) only")
        if args.speculative_num_draft_tokens is None:
            args.speculative_num_draft_tokens = args.speculative_num_steps + 1
        if args.speculative_num_draft_tokens != args.speculative_num_steps + 1:
            p.error(f"--speculative-num-draft-tokens must be num-steps + 1 = {args.speculative_num_steps + 1} "
                    f"with topk 1, got {args.speculative_num_draft_tokens}")
    if args.max_running_requests < 1:
        p.error(f"--max-running-requests must be >= 1, got {args.max_running_requests}")
    if args.dp_size < 1:
        p.error(f"--dp-size must be >= 1, got {args.dp_size}")
    ids = args.return_aux_hidden_state_layer_ids
    if ids is not None and (len(set(ids)) != len(ids) or min(ids) < 0):
        p.error(f"--return-aux-hidden-state-layer-ids must be unique and non-negative, got {ids}")
    return args



# ---------------------------------------------------------------------------------------------
# /generate request parsing: every error names the field
# ---------------------------------------------------------------------------------------------

def _parse_sampling(raw: Any, where: str) -> dict[str, Any]:
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise BadRequest(f"{where} must be an object, got {type(raw).__name__}")
    unknown = sorted(set(raw) - _SAMPLING_KEYS)
    if unknown:
        raise BadRequest(f"{where} has unknown fields {unknown}")
    for key, neutral in _NEUTRAL_SAMPLING.items():
        if key in raw and raw[key] != neutral:
            raise BadRequest(f"{where}.{key}={raw[key]!r} is not supported by eyas-local (only {neutral!r})")
    p = {"max_new_tokens": raw.get("max_new_tokens", 128), "temperature": raw.get("temperature", 1.0),
         "sampling_seed": raw.get("sampling_seed"), "ignore_eos": raw.get("ignore_eos", False),
         "stop_token_ids": raw.get("stop_token_ids") or [],
         "skip_special_tokens": raw.get("skip_special_tokens", True)}
    if not _is_int(p["max_new_tokens"]) or p["max_new_tokens"] < 0:
        raise BadRequest(f"{where}.max_new_tokens must be an integer >= 0, got {p['max_new_tokens']!r}")
    t = p["temperature"]
    if isinstance(t, bool) or not isinstance(t, (int, float)) or not t >= 0:
        raise BadRequest(f"{where}.temperature must be a number >= 0, got {t!r}")
    if p["sampling_seed"] is not None and not _is_int(p["sampling_seed"]):
        raise BadRequest(f"{where}.sampling_seed must be an integer, got {p['sampling_seed']!r}")
    if not isinstance(p["stop_token_ids"], list) or not all(_is_int(i) for i in p["stop_token_ids"]):
        raise BadRequest(f"{where}.stop_token_ids must be a list of integers")
    return p


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def parse_generate(body: Any, vocab_size: int, tokenizer) -> tuple[list[tuple[list[int], str, dict]], bool]:
    """A /generate body -> ([(input_ids, rid, sampling)], batched) or BadRequest naming the field."""
    if not isinstance(body, dict):
        raise BadRequest(f"the request body must be a JSON object, got {type(body).__name__}")
    unknown = sorted(set(body) - _GENERATE_KEYS)
    if unknown:
        raise BadRequest(f"unknown fields {unknown}")
    for key in sorted(_FALSY_FIELDS & set(body)):
        if key == "log_metrics" or (key == "logprob_start_len" and body[key] == -1):
            continue  # SGLang's defaults (log_metrics=True, logprob_start_len=-1)
        if body[key]:
            raise BadRequest(f"{key}={body[key]!r} is not supported by eyas-local (hidden states "
                             f"come through {DUMP_DIR_ENV}, not the response)")
    if ("input_ids" in body) == ("text" in body):
        raise BadRequest("give exactly one of input_ids and text")

    if "text" in body:
        if tokenizer is None:
            raise BadRequest("text needs a tokenizer, and the model folder has no tokenizer.json; "
                             "send input_ids")
        texts, batched = body["text"], isinstance(body["text"], list)
        texts = texts if batched else [texts]
        if not texts or not all(isinstance(t, str) for t in texts):
            raise BadRequest("text must be a string or a non-empty list of strings")
        seqs = [tokenizer.encode(t) for t in texts]
    else:
        raw = body["input_ids"]
        if not isinstance(raw, list) or not raw:
            raise BadRequest("input_ids must be a non-empty list of token ids, or a list of such lists")
        batched = isinstance(raw[0], list)
        seqs = raw if batched else [raw]
        for b, seq in enumerate(seqs):
            name = f"input_ids[{b}]" if batched else "input_ids"
            if not isinstance(seq, list) or not seq:
                raise BadRequest(f"{name} must be a non-empty list of token ids")
            for i, tok in enumerate(seq):
                if not _is_int(tok) or not 0 <= tok < vocab_size:
                    raise BadRequest(f"{name}[{i}] = {tok!r} is outside the vocabulary (0..{vocab_size - 1})")

    rids = body.get("rid")
    if rids is None:
        rids = [uuid.uuid4().hex for _ in seqs]
    elif batched != isinstance(rids, list):
        raise BadRequest(f"rid must be {'a list (batch input)' if batched else 'a string'}, got {rids!r}")
    elif not batched:
        rids = [rids]
    if len(rids) != len(seqs):
        raise BadRequest(f"rid has {len(rids)} entries for {len(seqs)} sequences")
    for rid in rids:  # a rid names its dump folder: safe characters and length (before set(): hashable)
        try:
            check_rid(rid)
        except ValueError as e:
            raise BadRequest(f"rid: {e}") from None
    if len(set(rids)) != len(rids):
        raise BadRequest(f"rid has duplicates: {rids}")

    sp = body.get("sampling_params")
    if isinstance(sp, list):
        if len(sp) != len(seqs):
            raise BadRequest(f"sampling_params has {len(sp)} entries for {len(seqs)} sequences")
        params = [_parse_sampling(s, f"sampling_params[{i}]") for i, s in enumerate(sp)]
    else:
        params = [_parse_sampling(sp, "sampling_params")] * len(seqs)
    return list(zip(seqs, rids, params)), batched


# ---------------------------------------------------------------------------------------------
# HTTP
# ---------------------------------------------------------------------------------------------

class ServerState:
    def __init__(self, engine: Engine, args: argparse.Namespace, model_info: dict, server_info: dict,
                 workers: list[Worker] | None = None):
        self.engine, self.args = engine, args
        self.model_info, self.server_info = model_info, server_info
        self.up = False  # SGLang's ServerStatus.Up: set after the warmup request
        self.workers = workers or []  # --dp-size: the other replicas (eyas/local/replicas.py)
        self._in_flight = [0] * (1 + len(self.workers))
        self._lock = threading.Lock()

    @contextmanager
    def replica(self) -> Iterator[Worker | None]:
        """The replica with the fewest requests in flight for one /generate call (None: this process's
        engine), as SGLang's data-parallel controller dispatches to the shortest queue."""
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

    def _send(self, status: int, payload: Any = None, *, close: bool = False, raw: bytes | None = None) -> None:
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
        if key is None or path.startswith("/health") or self.headers.get("Authorization") == f"Bearer {key}":
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
        if path in ("/server_info", "/get_server_info"):  # one internal state per DP replica, as SGLang
            engine = self.state.engine
            internal = [{"avg_spec_accept_length": engine.avg_spec_accept_length(),
                         "num_completion_tokens": engine.num_completion_tokens,
                         "spec_verify_ct": engine.num_verify_steps}]
            for w in self.state.workers:
                internal += json.loads(w.forward("GET", path, headers=self._auth())[1])["internal_states"]
            return self._send(200, {**self.state.server_info, "internal_states": internal})
        if path == "/flush_cache":
            return self._send(200)
        self._send(404, {"error": f"no route GET {path}"})

    def _body_length(self) -> int | None:
        """The body's length from Content-Length, or None once a 4xx has been sent (and the
        connection marked to close): a bad or huge length must not make a thread wait for bytes."""
        values = [v.strip() for v in self.headers.get_all("Content-Length") or []]
        if "chunked" in (self.headers.get("Transfer-Encoding") or "").lower():
            self._send(411, {"error": "chunked bodies are not supported: send the body with a "
                                      "Content-Length"}, close=True)
        elif len(set(values)) > 1:
            self._send(400, {"error": f"conflicting Content-Length headers {values}"}, close=True)
        elif values and not (values[0].isascii() and values[0].isdigit()):
            self._send(400, {"error": f"Content-Length {values[0][:40]!r} is not a byte count"}, close=True)
        elif values and (len(values[0]) > 12 or int(values[0]) > MAX_BODY_BYTES):
            self._send(413, {"error": f"the request body may have at most {MAX_BODY_BYTES} bytes, "
                                      f"Content-Length says {values[0][:40]}"}, close=True)
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
                    status, reply = worker.forward("POST", path, raw, {"Content-Type": "application/json",
                                                                       **self._auth()})
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
        params = _parse_sampling({"max_new_tokens": 1, "temperature": 0}, "health")
        try:
            self.state.engine.generate([0], f"HEALTH_CHECK_{time.time()}", params)
        except Exception:  # noqa: BLE001
            log(f"Health check failed. {traceback.format_exc()}")
            return self._send(503)
        self._send(200)


def _warmup_then_ready(state: ServerState, url: str, skip_warmup: bool) -> None:
    """SGLang's _wait_and_warmup: one real request over HTTP, then the ready line."""
    if not skip_warmup:
        body = {"sampling_params": {"temperature": 0, "max_new_tokens": 8},
                "rid": f"WARMUP_{uuid.uuid4().hex}"}
        if state.engine.tokenizer is not None:
            body["text"] = "The capital city of France is"
        else:
            body["input_ids"] = [i % state.engine.vocab_size for i in (10, 11, 12)]
        try:
            key = state.args.api_key
            req = urllib.request.Request(f"{url}/generate", data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json",
                                                  **({"Authorization": f"Bearer {key}"} if key else {})})
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


def main(argv: list[str] | None = None) -> int:
    raw_argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(raw_argv)
    if args.dp_worker:
        exit_with_parent()
    else:
        exit_with_launcher(log)
    shown = {**vars(args), "api_key": None if args.api_key is None else "***"}
    log(f"server_args={shown}")
    if args.tp_size != 1:
        log(f"tp_size={args.tp_size} ignored: eyas-local runs the whole model in one CPU process")
    if args.dtype not in ("auto", "float32"):
        log(f"dtype={args.dtype} ignored: eyas-local computes in float32 on CPU")

    # 1. Load the model (and fail here, as SGLang would, if a fault is injected)
    workers = []  # --dp-size: the other replicas, this server again as worker processes; they load
    if args.dp_size > 1:  # their models while this one loads its own
        log(f"dp_size={args.dp_size}: starting {args.dp_size - 1} more replica(s) of the model")
        workers = start_workers(raw_argv, args.dp_size - 1)
    model = load_model(args.model_path, load_delay=args.load_delay, fault=args.fault,
                       fault_shard=args.fault_shard)
    tokenizer = optional_tokenizer(args.model_path)

    # 2. Hidden-state capture: dump only when asked for on the command line and given a folder
    num_layers = model.config.num_hidden_layers
    capture_ids = resolve_capture_ids(args.return_aux_hidden_state_layer_ids, num_layers)
    dump_dir = os.environ.get(DUMP_DIR_ENV)
    writer = None
    if args.enable_return_aux_hidden_states and dump_dir:
        writer = DumpWriter(dump_dir, layer_ids=capture_ids, dtype=dtype_from_env())
        log(f"Dumping aux hidden states of layers {capture_ids} to {dump_dir} ({writer.dtype})")
    elif dump_dir:
        log(f"{DUMP_DIR_ENV} is set but --enable-return-aux-hidden-states is not: no dump")
    speculative = None
    if args.speculative_draft_model_path is not None:
        speculative = Speculative.load(args.speculative_draft_model_path, args.model_path,
                                       num_steps=args.speculative_num_steps, num_target_layers=num_layers)
    engine = Engine(model, tokenizer, chunk_size=args.chunked_prefill_size, writer=writer,
                    capture_ids=capture_ids, seed=args.random_seed, speculative=speculative,
                    max_running=args.max_running_requests, think_tokens=args.think_tokens)
    if workers:
        wait_ready(workers, log)
        log(f"dp_size={args.dp_size}: {args.dp_size} replicas ready (pids {[w.proc.pid for w in workers]} "
            f"besides this one); each request goes to the least busy")

    # 3. Serve, then warm up over HTTP and announce readiness
    served = args.served_model_name or args.model_path
    model_info = {"model_path": args.model_path, "tokenizer_path": args.model_path,
                  "served_model_name": served, "is_generation": True,
                  "architectures": list(model.config.architectures or [type(model).__name__]),
                  "model_type": model.config.model_type, "weight_version": "default",
                  "preferred_sampling_params": None, "has_image_understanding": False,
                  "has_audio_understanding": False}
    server_info = {**shown, "served_model_name": served, "version": __version__,
                   "backend": "eyas-local", "dump_dir": dump_dir if writer else None,
                   "aux_hidden_state_layer_ids": capture_ids if writer else None,
                   "layer_convention": "capture-before", "hidden_size": model.config.hidden_size,
                   "num_hidden_layers": num_layers, "vocab_size": model.config.vocab_size,
                   "context_length": engine.context_len, "internal_states": [{}]}
    httpd = _HTTPServer((args.host, args.port), Handler)
    httpd.state = ServerState(engine, args, model_info, server_info, workers)  # type: ignore[attr-defined]
    url = f"http://{args.host}:{args.port}"
    log(f"INFO:     Uvicorn running on {url} (Press CTRL+C to quit)")
    threading.Thread(target=_warmup_then_ready, args=(httpd.state, url, args.skip_server_warmup),
                     daemon=True).start()
    try:
        httpd.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        httpd.server_close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
