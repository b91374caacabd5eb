"""Loading a config: YAML (or a mapping) plus dotted overrides -> a validated PipelineConfig.

Relative paths resolve against the YAML file's directory; a bad field fails naming the file, the
field and the value.
"""

from __future__ import annotations

import copy
import os
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from eyas.config.base import ConfigError
from eyas.config.models import PipelineConfig

_LOCAL_PATHS = [
    "run_dir",
    "data.path",
    "target.local_dir",
    "data.regenerate.output_dir",
    "extraction.output_dir",
    "training.output_dir",
    "training.init_from",
]
_SERVER_PATHS = ["target.checkpoint", "server.workdir", "server.dump_dir"]


def load_config(path: str | Path, overrides: dict[str, Any] | None = None) -> PipelineConfig:
    """Read a YAML config, apply dotted overrides ("training.max_steps": 5), validate, resolve
    paths."""
    path = Path(path)
    try:
        raw = yaml.safe_load(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"{path}: config file not found") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: not valid YAML: {e}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: expected a mapping at the top level, got {type(raw).__name__}")
    return config_from_dict(
        raw, base_dir=path.resolve().parent, source=str(path), overrides=overrides
    )


def config_from_dict(
    raw: dict[str, Any],
    base_dir: Path,
    source: str = "<dict>",
    overrides: dict[str, Any] | None = None,
) -> PipelineConfig:
    """Validate a config mapping; relative local paths are resolved against base_dir."""
    raw = apply_overrides(raw, overrides)
    try:
        cfg = PipelineConfig.model_validate(raw)
    except ValidationError as e:
        raise ConfigError(_describe(e, source)) from None
    fields = _LOCAL_PATHS + (_SERVER_PATHS if cfg.server.host.kind == "local" else [])
    for dotted in fields:
        _resolve(cfg, dotted, base_dir)
    if cfg.server.host.kind == "local" and cfg.server.python:
        cfg.server.python = _local_python(cfg.server.python, base_dir)
    _check_server_folders(cfg, source)
    return cfg


_HOME_PARENTS = (Path("/home"), Path("/Users"))


def _check_server_folders(cfg: PipelineConfig, source: str) -> None:
    """server.workdir and server.dump_dir get eyas's files, and the dump folder is emptied: never a
    filesystem root or a home folder, and the dump folder never holds the workdir (log, pid
    record)."""
    s = cfg.server
    homes = {
        Path("/root"),
        *_HOME_PARENTS,
        *([Path.home().resolve()] if s.host.kind == "local" else []),
    }
    work, dump = (Path(os.path.normpath(p)) for p in (s.workdir, s.dump_dir))
    for field, p in (("server.workdir", work), ("server.dump_dir", dump)):
        why = (
            "is a filesystem root"
            if p == Path(p.anchor)
            else "is a home folder"
            if p in homes or p.parent in _HOME_PARENTS
            else None
        )
        if why:
            raise ConfigError(
                f"{source}: {field}: {p} {why}; eyas writes files there (and empties the dump "
                f"folder): give it a folder of its own, e.g. {p / 'eyas'}"
            )
    if dump == work or dump in work.parents:
        raise ConfigError(
            f"{source}: server.dump_dir: {dump} holds server.workdir {work} (the log and the "
            f"launch record); eyas empties the dump folder: use a folder of its own, "
            f"e.g. {work / 'dump'}"
        )


def parse_overrides(pairs: list[str]) -> dict[str, Any]:
    """`--set key=value` pairs -> dotted overrides, each value read as YAML (50 an int, null
    None)."""
    out = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep:
            raise ConfigError(f"--set expects key=value, got {pair!r}")
        out[key] = yaml.safe_load(value)
    return out


def apply_overrides(raw: dict[str, Any], overrides: dict[str, Any] | None) -> dict[str, Any]:
    """A copy of raw with dotted overrides set in it ({"training.max_steps": 5}:
    raw["training"]["max_steps"])."""
    raw = copy.deepcopy(raw)
    for dotted, value in (overrides or {}).items():
        *parents, leaf = dotted.split(".")
        node = raw
        for key in parents:
            node = node.setdefault(key, {})
        node[leaf] = value
    return raw


def _local_python(python: str, base_dir: Path) -> str:
    """server.python on this machine: `~` expanded, a relative path read from the config's folder,
    a bare command name (python3) left for the shell's PATH."""
    if python.startswith("~"):
        return os.path.expanduser(python)
    if "/" in python and not Path(python).is_absolute():
        return str((base_dir / python).resolve())
    return python


def _resolve(cfg: BaseModel, dotted: str, base_dir: Path) -> None:
    *parents, leaf = dotted.split(".")
    node = cfg
    for key in parents:
        node = getattr(node, key)
    value = getattr(node, leaf)
    if value is not None and not Path(value).is_absolute():
        setattr(node, leaf, (base_dir / value).resolve())


def _describe(e: ValidationError, source: str) -> str:
    lines = [f"{source}: invalid config ({e.error_count()} problem(s))"]
    for err in e.errors():
        field = ".".join(str(p) for p in err["loc"]) or "<top level>"
        value = err.get("input")
        shown = repr(value) if not isinstance(value, dict) else "{...}"
        lines.append(f"  - {field}: {err['msg']} (got {shown})")
    return "\n".join(lines)
