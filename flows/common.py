"""What every eyas flow shares: the config parameter, the stop-on-failure hooks (STOP_ON_FAILURE),
the one-line failure reason (flows/failures.py). The per-host GPU lock is
flows/runtime/host_lock.py.

A flow's `config` parameter is either a path to a YAML config (relative paths are taken from the
repository root, so deployments work from any working directory), an inline mapping with the same
fields, or an already loaded PipelineConfig (what `eyas run` passes). `overrides` are dotted fields
applied on top ({"training.max_steps": 20}), exactly like `eyas run --set`.

Prefect stores a run's parameters in its database: a loaded config is stored with its secrets masked
(SecretStr, the --api-key value), but an inline mapping or overrides are stored as sent, so secret
values there are refused (docs/operations.md, "Secrets").
"""

from __future__ import annotations

import functools
import inspect
from pathlib import Path
from typing import Any, Union

import prefect
from prefect.artifacts import create_markdown_artifact
from prefect.logging import get_run_logger
from prefect.states import Failed

from eyas.config import ConfigError, PipelineConfig, config_from_dict, load_config
from eyas.config.loading import apply_overrides
from eyas.evaluation import serve_bench
from eyas.report import artifact_key
from eyas.resources import shipped_root
from eyas.secrets import MASK, PYDANTIC_MASK, secret_flag_values
from eyas.server.hosts import make_host
from eyas.server.launch import stop_recorded
from flows import failures

failures.install()  # Prefect's run loggers: the reason once, no traceback for eyas's own errors

ROOT = shipped_root()  # relative config paths: the checkout, or the wheel's shipped copy
DEFAULT_CONFIG = "configs/local-tiny.yaml"

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
    a failed run with its reason first. A bad config ends the run Failed, its state message the
    ConfigError on one line; a good one tags the flow run and every task and subflow run inside it
    (run_tags). Whatever the body raises ends the run Failed("failed at TASK: reason") carrying the
    exception (flows/failures.py); the top-level run also writes the artifact `failure-NAME`."""
    signature = inspect.signature(fn)

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        config, overrides = bound.arguments["config"], bound.arguments.get("overrides")
        try:
            cfg = resolve_config(config, overrides)
        except ConfigError as e:
            return _failed(e, "config", config_label(config, overrides))
        tags = run_tags(cfg)
        _tag_flow_run(tags)
        with prefect.tags(*tags):
            try:
                return fn(*args, **kwargs)
            except Exception as e:  # noqa: BLE001 - every failure ends as one line; BaseException (signals) passes
                return _failed(e, _flow_name(fn), cfg.name)

    return wrapper


def _flow_name(fn) -> str:
    from prefect.runtime import flow_run

    return flow_run.flow_name or fn.__name__


def _failed(error: Exception, where: str, name: str):
    """The run's final state: Failed, its message `failed at TASK: reason`, its data the exception
    (so a caller's `state.result()` raises it as before). An error no task reported (raised by the
    flow body itself) is logged here: one line for eyas's own, with its traceback for anything
    else."""
    from prefect.runtime import flow_run

    line = failures.failure_line(error, where)
    if not failures.printed(line) and not getattr(error, "eyas_failed_task", None):
        try:
            log = get_run_logger()
            if failures.eyas_raised(error):
                log.error("%s", line)
            else:
                log.error("%s", line, exc_info=error)
            failures.remember(
                line
            )  # the run's "Finished in state Failed" line then names the task only
        except Exception:  # noqa: BLE001 - outside a run context
            pass
    try:
        error.eyas_reported = (
            True  # a worker's "Engine execution exited ..." traceback is then not logged
        )
    except Exception:  # noqa: BLE001 - an exception type without a __dict__
        pass
    if not flow_run.parent_flow_run_id:
        try:
            create_markdown_artifact(
                key=artifact_key("failure", name),
                description=line[:500],
                markdown=failures.failure_markdown(
                    flow_run.name or name, line, failures.recent_lines()
                ),
            )
        except Exception:  # noqa: BLE001 - the artifact is a view; the state message has the reason
            pass
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
            config, base_dir=ROOT, source="<inline config>", overrides=overrides
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
    launched nothing and stops nothing."""
    try:
        cfg = resolve_config(flow_run.parameters["config"], flow_run.parameters.get("overrides"))
    except Exception:  # noqa: BLE001 - a bad config never launched anything (the run's message says why)
        print("stop-server hook: the config did not load, so nothing was launched: nothing to stop")
        return
    mine, benchmarked = (
        {str(flow_run.id)},
        cfg.benchmark.enabled or cfg.evaluation.method == "server",
    )
    with make_host(cfg.server.host) as host:
        _say_stopped(
            state, cfg, cfg, stop_recorded(host, cfg, runs=mine)
        )  # the target server first
        for launched in (
            serve_bench.launches(cfg) if benchmarked else []
        ):  # what serve_bench_flow launches
            _say_stopped(state, cfg, launched, stop_recorded(host, launched, runs=mine))


def _say_stopped(state, cfg: PipelineConfig, server: PipelineConfig, outcome: dict) -> None:
    said = str(outcome.get("outcome", ""))
    if server is not cfg and said.startswith(("not running", "left alone")):
        return  # a benchmark server this run never started: nothing worth a line
    # a run that launched nothing (a refusal, a bad input) says so quietly: its reason is elsewhere
    level = 20 if said.startswith("not running") else 30
    where = "" if server is cfg else f" ({server.server.workdir.name})"
    try:
        get_run_logger().log(
            level,
            "run %s: the server this run launched on %s%s: %s",
            state.name,
            cfg.server.host.name,
            where,
            outcome,
        )
    except Exception:  # noqa: BLE001 - hooks may run without a run context
        print(f"stop-server hook ({state.name}){where}: {outcome}")


#: every flow's hooks: whatever ends a run early, the servers it launched are stopped
STOP_ON_FAILURE = {
    "on_failure": [stop_server_hook],
    "on_crashed": [stop_server_hook],
    "on_cancellation": [stop_server_hook],
}
