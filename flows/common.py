"""What every eyas flow shares: the config parameter, the per-host GPU lock (flows/host_lock.py), the
stop-on-failure hook.

A flow's `config` parameter is either a path to a YAML config (relative paths are taken from the
repository root, so deployments work from any working directory), an inline mapping with the same
fields, or an already loaded PipelineConfig (what `eyas run` passes). `overrides` are dotted fields
applied on top ({"training.max_steps": 20}), exactly like `eyas run --set`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Union

from prefect.logging import get_run_logger

from eyas.config import PipelineConfig, config_from_dict, load_config
from eyas.resources import shipped_root
from eyas.server.hosts import make_host
from eyas.server.launch import stop_server
from flows.host_lock import ensure_host_limit, gpu_host, host_limit_name  # noqa: F401 - the flows' lock

ROOT = shipped_root()  # relative config paths: the checkout, or the wheel's shipped copy
DEFAULT_CONFIG = "configs/local-tiny.yaml"

ConfigParam = Union[str, dict[str, Any], PipelineConfig]


def resolve_config(config: ConfigParam, overrides: dict[str, Any] | None = None) -> PipelineConfig:
    """A path, an inline mapping or a PipelineConfig, plus dotted overrides -> a validated config."""
    if isinstance(config, PipelineConfig):
        if not overrides:
            return config
        config = config.model_dump(mode="json")
    if isinstance(config, dict):
        return config_from_dict(config, base_dir=ROOT, source="<inline config>", overrides=overrides)
    path = Path(config)
    return load_config(path if path.is_absolute() else ROOT / path, overrides)


def stop_server_hook(flow, flow_run, state) -> None:
    """on_failure / on_crashed / on_cancellation: stop the server this run (or a subflow of it)
    launched, so no failed run holds GPUs. Another run's server is left alone: a run that failed
    because another one holds the config (OutputBusy) launched nothing and stops nothing."""
    try:
        cfg = resolve_config(flow_run.parameters["config"], flow_run.parameters.get("overrides"))
    except Exception as e:  # noqa: BLE001 - a bad config never launched anything
        print(f"stop-server hook: config unreadable ({e}); nothing to stop")
        return
    host = make_host(cfg.server.host)
    try:
        outcome = stop_server(host, cfg, runs={str(flow_run.id)})
    finally:
        host.close()
    try:
        get_run_logger().warning("run %s: the server this run launched on %s: %s", state.name,
                                 cfg.server.host.name, outcome)
    except Exception:  # noqa: BLE001 - hooks may run without a run context
        print(f"stop-server hook ({state.name}): {outcome}")
