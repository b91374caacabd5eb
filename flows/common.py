"""What every eyas flow shares: the config parameter, the per-host GPU lock, the stop-on-failure hook.

A flow's `config` parameter is either a path to a YAML config (relative paths are taken from the
repository root, so deployments work from any working directory), an inline mapping with the same
fields, or an already loaded PipelineConfig (what `eyas run` passes). `overrides` are dotted fields
applied on top ({"training.max_steps": 20}), exactly like `eyas run --set`.

Prefect stores a run's parameters in its database: a loaded config is stored with its secrets masked
(SecretStr, the --api-key value), but an inline mapping or overrides are stored as sent, so secret
values there are refused (docs/operations.md, "Secrets").
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator, Union

from prefect.concurrency.sync import concurrency
from prefect.logging import get_logger, get_run_logger

from eyas.config import ConfigError, PipelineConfig, config_from_dict, load_config
from eyas.secrets import MASK, PYDANTIC_MASK, secret_flag_values
from eyas.resources import shipped_root
from eyas.server.hosts import make_host
from eyas.server.launch import stop_server
from eyas.extraction.locks import hold_lock, release_lock

ROOT = shipped_root()  # relative config paths: the checkout, or the wheel's shipped copy
DEFAULT_CONFIG = "configs/local-tiny.yaml"

ConfigParam = Union[str, dict[str, Any], PipelineConfig]


def resolve_config(config: ConfigParam, overrides: dict[str, Any] | None = None) -> PipelineConfig:
    """A path, an inline mapping or a PipelineConfig, plus dotted overrides -> a validated config."""
    _refuse_secrets(_nested(overrides or {}), "overrides")
    if isinstance(config, PipelineConfig):
        if not overrides:
            return config
        # python mode: secrets stay SecretStr (mode="json" would give their masks)
        return config_from_dict(config.model_dump(), base_dir=ROOT, source="<config>", overrides=overrides)
    if isinstance(config, dict):
        _refuse_secrets(config, "an inline config")
        return config_from_dict(config, base_dir=ROOT, source="<inline config>", overrides=overrides)
    path = Path(config)
    return load_config(path if path.is_absolute() else ROOT / path, overrides)


def _nested(overrides: dict[str, Any]) -> dict:
    out: dict = {}
    for dotted, value in overrides.items():
        *parents, leaf = dotted.split(".")
        node = out
        for key in parents:
            node = node.setdefault(key, {})
        node[leaf] = value
    return out


def _refuse_secrets(raw: dict, where: str) -> None:
    """A secret value in a flow run's parameters is already in Prefect's database: refuse it, loudly.
    The masks a loaded config is stored with (a failure hook reads them back) pass."""
    server = raw.get("server") if isinstance(raw.get("server"), dict) else {}
    named = [f"server.secret_env.{k}" for k, v in (server.get("secret_env") or {}).items()
             if str(getattr(v, "get_secret_value", lambda: v)()) != PYDANTIC_MASK]
    if any(v != MASK for v in secret_flag_values(map(str, server.get("launch_args") or []))):
        named.append("server.launch_args (--api-key)")
    if named:
        raise ConfigError(f"{where} carries secret values ({', '.join(named)}): a flow run's parameters are "
                         f"stored in the Prefect database as sent. Keep secrets in a config file on the worker "
                         f"(server.secret_env) or in the worker's environment (server.env_from), and treat "
                         f"these values as leaked")


def host_limit_name(cfg: PipelineConfig) -> str:
    """The global concurrency limit that owns a server host's GPUs (one server at a time)."""
    return f"eyas-gpu-host-{cfg.server.host.name}"


def ensure_host_limit(cfg: PipelineConfig) -> str:
    """Create the host's limit (1 slot) if nobody has; an operator may have made it already."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import GlobalConcurrencyLimitCreate
    from prefect.exceptions import ObjectAlreadyExists, ObjectNotFound

    name = host_limit_name(cfg)
    with get_client(sync_client=True) as client:
        try:
            client.read_global_concurrency_limit_by_name(name)
        except ObjectNotFound:
            try:
                client.create_global_concurrency_limit(GlobalConcurrencyLimitCreate(name=name, limit=1))
            except ObjectAlreadyExists:
                pass
    return name


def lock_dir() -> Path:
    """Where the per-host OS locks live: $EYAS_LOCK_DIR, else PREFECT_HOME/eyas-locks.

    Every run that drives a given GPU host must see the same directory (one worker machine, or a
    shared EYAS_LOCK_DIR); docs/operations.md says why.
    """
    from prefect.settings import get_current_settings

    env = os.environ.get("EYAS_LOCK_DIR")
    return Path(env) if env else Path(get_current_settings().home) / "eyas-locks"


def free_dead_slots(name: str) -> int:
    """Give back the slots of `name` that runs killed with -9 kept. Only call it holding the host's
    OS lock: then no live run holds a slot, so every occupied one is a dead run's."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import GlobalConcurrencyLimitUpdate

    with get_client(sync_client=True) as client:
        held = client.read_global_concurrency_limit_by_name(name).active_slots
        if held:
            client.update_global_concurrency_limit(name, GlobalConcurrencyLimitUpdate(active_slots=0))
    return held


@contextmanager
def gpu_host(cfg: PipelineConfig) -> Iterator[None]:
    """Own the server host while a server lives there: a second run waits, never doubles.

    First the host's OS lock (an flock in lock_dir(): the kernel drops it when its holder dies, even
    by kill -9), then the strict Prefect limit of one slot (what the UI shows on its Concurrency
    page), after giving back any slot a killed run kept.
    """
    name, log = ensure_host_limit(cfg), _logger()
    path = lock_dir() / f"{name}.lock"

    def waiting(pid: str) -> None:
        log.info("waiting for GPU host %s: another run (pid %s) holds it", cfg.server.host.name, pid)

    hold_lock(path, wait_s=float("inf"), what=f"GPU host {cfg.server.host.name}", on_wait=waiting)
    try:
        freed = free_dead_slots(name)
        if freed:
            log.warning("gave back %d slot(s) of %s kept by a killed run", freed, name)
        with concurrency(name, occupy=1, strict=True):
            yield
    finally:
        release_lock(path)


def _logger():
    try:
        return get_run_logger()
    except Exception:  # noqa: BLE001 - outside a run context
        return get_logger("eyas.flows")


def stop_server_hook(flow, flow_run, state) -> None:
    """on_failure / on_crashed: stop the server the run launched, so no failed run holds GPUs."""
    try:
        cfg = resolve_config(flow_run.parameters["config"], flow_run.parameters.get("overrides"))
    except Exception as e:  # noqa: BLE001 - a bad config never launched anything
        print(f"stop-server hook: config unreadable ({e}); nothing to stop")
        return
    host = make_host(cfg.server.host)
    try:
        outcome = stop_server(host, cfg)
    finally:
        host.close()
    try:
        get_run_logger().warning("run %s: stopped the server on %s: %s", state.name,
                                 cfg.server.host.name, outcome)
    except Exception:  # noqa: BLE001 - hooks may run without a run context
        print(f"stop-server hook ({state.name}): {outcome}")
