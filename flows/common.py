"""What every eyas flow shares: the config parameter, the stop-on-failure hooks (STOP_ON_FAILURE),
the one-line failure reason in the run's final state (flows/failures.py). The per-host GPU lock is
flows/runtime/host_lock.py.

A flow's `config` parameter is either a path to a YAML config (relative paths are taken from the
repository root, so deployments work from any working directory), an inline mapping with the same
fields (its relative paths are taken from the repository's `configs/` folder, as if the mapping were
a file there: a config file pasted inline means what the file means), or an already loaded
PipelineConfig (what `eyas run` passes). `overrides` are dotted fields
applied on top ({"training.max_steps": 20}), exactly like `eyas run --set`.

Prefect stores a run's parameters in its database: a loaded config is stored with its secrets masked
(SecretStr, the --api-key value), but an inline mapping or overrides are stored as sent, so secret
values there are refused (docs/operations.md, "Secrets").
"""

from __future__ import annotations

import functools
import inspect
import logging
from pathlib import Path
from typing import Any, Union

import prefect
from eyas_prefect.flows import failures
from eyas_prefect.flows.runtime.prefect_private import cancel_requested
from prefect.exceptions import TerminationSignal
from prefect.logging import get_run_logger
from prefect.logging.loggers import flow_run_logger
from prefect.states import Failed

from eyas.config import ConfigError, PipelineConfig, config_from_dict, load_config
from eyas.config.loading import apply_overrides
from eyas.evaluation import serve_bench
from eyas.resources import shipped_root
from eyas.secrets import MASK, PYDANTIC_MASK, secret_flag_values
from eyas.server.hosts import make_host
from eyas.server.launch import capture_launch, stop_recorded

failures.install()  # Prefect's run loggers: no traceback for eyas's own errors

ROOT = shipped_root()  # relative config paths: the checkout, or the wheel's shipped copy
DEFAULT_CONFIG = "configs/local-tiny.yaml"
INLINE_BASE = ROOT / "configs"  # an inline config's relative paths: as in a file of configs/

ConfigParam = Union[str, dict[str, Any], PipelineConfig]
#: dotted field -> value; typed so that Prefect's run form and the API's parameter schema show it
Overrides = dict[str, Union[str, int, float, bool, list, dict, None]]


def one_line(error: Exception) -> str:
    """A ConfigError's message on one line (a flow run's state message): `file: invalid config: a;
    b`."""
    head, *problems = str(error).splitlines()
    head = head.split(" (", 1)[0] if problems and head.endswith("problem(s))") else head
    return (
        f"{head}: " + "; ".join(p.strip().removeprefix("- ") for p in problems)
        if problems
        else head
    )


def config_label(config: Any, overrides: dict | None = None) -> str:
    """A name for a config that may not load: its `name` (overrides first), else the file's stem."""
    for src in (overrides or {}, config if isinstance(config, dict) else {}):
        if isinstance(src.get("name"), str) and src["name"]:
            return src["name"]
    if isinstance(config, PipelineConfig):
        return config.name
    return Path(config).stem if isinstance(config, str) and config else "inline"


def run_tags(cfg: PipelineConfig) -> list[str]:
    """The tags every flow and task run of a config carries: config name, server host, target
    revision."""
    return [
        f"config:{cfg.name}",
        f"host:{cfg.server.host.name}",
        f"revision:{cfg.target.revision or 'unpinned'}",
    ]


def checked_flow(fn):
    """Between @flow and the function: validate `config` + `overrides` before anything runs, and end
    a failed run with its reason. A bad config ends the run Failed, its state message the
    ConfigError on one line; a good one tags the flow run and every task and subflow run inside it
    (run_tags). Whatever the body raises ends the run Failed("failed at TASK: reason") carrying the
    exception, so a caller's `state.result()` raises it (flows/failures.py). An operator's cancel
    says so in the run's log and passes on to Prefect, which ends the run Cancelled."""
    signature = inspect.signature(fn)

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        config, overrides = bound.arguments["config"], bound.arguments.get("overrides")
        try:
            cfg = resolve_config(config, overrides)
        except ConfigError as e:
            return Failed(message=f"failed at config: {failures.reason_of(e)}", data=e)
        tags = run_tags(cfg)
        _tag_flow_run(tags)
        with prefect.tags(*tags):
            try:
                return fn(*args, **kwargs)
            except TerminationSignal:
                if cancel_requested():
                    get_run_logger().warning(
                        "cancelled by the operator: stopping this run and the servers it launched"
                    )
                raise
            except Exception as e:  # noqa: BLE001 - every failure ends as one line; BaseException (signals) passes
                return _failed(e, _flow_name(fn))

    return wrapper


def _flow_name(fn) -> str:
    from prefect.runtime import flow_run

    return flow_run.flow_name or fn.__name__


def _failed(error: Exception, where: str):
    """The run's final state: Failed, its message `failed at TASK: reason`, its data the exception.
    A bug the body raised outside any task is logged here with its traceback (Prefect logs only
    its tasks' exceptions, and this run ends by a returned state, not an exception)."""
    from prefect.runtime import flow_run

    line = failures.failure_line(error, where, flow_run.id)
    if line.startswith(f"failed at {where}: ") and not failures.eyas_raised(error):
        get_run_logger().error("%s", line, exc_info=error)
    return Failed(message=line, data=error)


def _tag_flow_run(tags: list[str]) -> None:
    from prefect.client.orchestration import get_client
    from prefect.context import FlowRunContext

    ctx = FlowRunContext.get()
    if ctx is None or ctx.flow_run is None or set(tags) <= set(ctx.flow_run.tags):
        return
    merged = sorted({*ctx.flow_run.tags, *tags})
    with get_client(sync_client=True) as client:
        client.update_flow_run(ctx.flow_run.id, tags=merged)
    ctx.flow_run.tags = merged


def resolve_config(config: ConfigParam, overrides: dict[str, Any] | None = None) -> PipelineConfig:
    """A path, an inline mapping or a PipelineConfig, plus dotted overrides -> a validated
    config."""
    _refuse_secrets(apply_overrides({}, overrides), "overrides")
    if isinstance(config, PipelineConfig):
        if not overrides:
            return config
        # python mode: secrets stay SecretStr (mode="json" would give their masks)
        return config_from_dict(
            config.model_dump(), base_dir=ROOT, source="<config>", overrides=overrides
        )
    if isinstance(config, dict):
        _refuse_secrets(config, "an inline config")
        return config_from_dict(
            config, base_dir=INLINE_BASE, source="<inline config>", overrides=overrides
        )
    path = Path(config)
    return load_config(path if path.is_absolute() else ROOT / path, overrides)


def _refuse_secrets(raw: dict, where: str) -> None:
    """A secret value in a flow run's parameters is already in Prefect's database: refuse it,
    loudly. The masks a loaded config is stored with (a failure hook reads them back) pass."""
    server = raw.get("server") if isinstance(raw.get("server"), dict) else {}
    named = [
        f"server.secret_env.{k}"
        for k, v in (server.get("secret_env") or {}).items()
        if str(getattr(v, "get_secret_value", lambda v=v: v)()) != PYDANTIC_MASK
    ]
    if any(v != MASK for v in secret_flag_values(map(str, server.get("launch_args") or []))):
        named.append("server.launch_args (--api-key)")
    if named:
        raise ConfigError(
            f"{where} carries secret values ({', '.join(named)}): a flow run's parameters are "
            f"stored in the Prefect database as sent. Keep secrets in a config file on the worker "
            f"(server.secret_env) or in the worker's environment (server.env_from), and treat "
            f"these values as leaked"
        )


def stop_server_hook(flow, flow_run, state) -> None:
    """on_failure / on_crashed / on_cancellation: stop every server this run (or a subflow of it)
    launched, the target server and the serving benchmark's, so no failed run holds GPUs. Another
    run's server is left alone: a run that failed because another one holds the config (OutputBusy)
    launched nothing and stops nothing. It says what it did in a sentence in the run's own log
    (also where Prefect runs it outside the run, on a cancel), and never raises: the run's reason
    is elsewhere, and a hook's traceback would bury it."""
    log = flow_run_logger(flow_run, flow)
    try:
        cfg = resolve_config(flow_run.parameters["config"], flow_run.parameters.get("overrides"))
    except Exception:  # noqa: BLE001 - a bad config never launched anything (the run's message says why)
        log.info("run %s: its config did not load, so it launched no server", state.name)
        return
    mine = {str(flow_run.id)}
    benchmarked = cfg.benchmark.enabled or cfg.evaluation.method == "server"
    try:
        with make_host(cfg.server.host) as host:
            capture = capture_launch(cfg)
            outcomes = [
                (capture, stop_recorded(host, capture, runs=mine))
            ]  # the target server first
            for launched in serve_bench.launches(cfg) if benchmarked else []:
                outcomes.append((launched, stop_recorded(host, launched, runs=mine)))
    except Exception as e:  # noqa: BLE001 - a hook that raises hides the run's reason
        log.error(
            "run %s: could not reach %s to stop the servers this run launched (%s); stop them "
            "with `eyas stop` and this run's config",
            state.name,
            cfg.server.host.name,
            failures.reason_of(e),
        )
        return
    for launched, outcome in outcomes:
        level, sentence = stop_sentence(outcome, cfg.server.host.name, server_words(launched))
        if sentence:
            log.log(level, "run %s: %s", state.name, sentence)


def server_words(launched) -> str:
    """How a stop sentence names a launch: "the server" (the target's capture launch), or "the
    benchmark server spec-3-1-4 (sglang)" (its workdir bench-<label>, its backend)."""
    if launched.mode == "capture":
        return "the server"
    label = Path(launched.server.workdir).name.removeprefix("bench-")
    return f"the benchmark server {label} ({launched.server.backend})"


def stop_sentence(outcome: dict, host: str, which: str = "the server") -> tuple[int, str]:
    """A stop_recorded outcome as (log level, sentence), naming the server `which`; no sentence
    for a benchmark server this run never started."""
    said, pid = str(outcome.get("outcome", "")), outcome.get("pid")
    target = which == "the server"
    if not target and (pid is None or said.startswith("left alone")):
        return logging.INFO, ""
    dump = f"; its dump folder: {outcome['dump_dir']}" if outcome.get("dump_dir") else ""
    if pid is None:
        return logging.INFO, f"it launched no server on {host}: nothing to stop"
    if said.startswith("left alone"):
        return logging.INFO, f"{which} on {host} (pid {pid}) was {said}"
    if said.startswith("not running"):
        return logging.INFO, f"{which} it launched on {host} (pid {pid}) had already exited{dump}"
    return logging.WARNING, f"stopped {which} it launched on {host} (pid {pid}, {said}){dump}"


#: every flow's hooks: whatever ends a run early, the servers it launched are stopped; a failed
#: top-level run also writes its artifact `failure-NAME`
STOP_ON_FAILURE = {
    "on_failure": [stop_server_hook, failures.failure_artifact_hook],
    "on_crashed": [stop_server_hook],
    "on_cancellation": [stop_server_hook],
}
