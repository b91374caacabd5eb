"""The flows' config parameter: a YAML path, an inline mapping, or a loaded config, plus
overrides."""

import re

import pytest
import yaml

from eyas.config import ConfigError, load_config
from flows.common import ROOT, resolve_config
from flows.runtime.host_lock import host_limit_name


def test_a_path_is_taken_from_the_repository_root_wherever_the_run_starts(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg = resolve_config("configs/local-tiny.yaml", {"training.max_steps": 20})
    assert cfg == load_config(ROOT / "configs" / "local-tiny.yaml", {"training.max_steps": 20})
    assert (
        cfg.training.max_steps == 20 and cfg.target.checkpoint == ROOT / "fixtures" / "tiny-target"
    )


def test_an_inline_mapping_resolves_relative_paths_against_the_repository_root():
    raw = yaml.safe_load((ROOT / "configs" / "local-tiny.yaml").read_text())
    for section, key in (("target", "checkpoint"), ("data", "path")):
        raw[section][key] = raw[section][key].removeprefix("../")
    raw["run_dir"] = "runs/inline"
    cfg = resolve_config(raw, {"name": "inline"})
    assert cfg.name == "inline" and cfg.run_dir == ROOT / "runs" / "inline"
    assert cfg.target.checkpoint == ROOT / "fixtures" / "tiny-target"


def test_a_loaded_config_passes_through_and_takes_overrides():
    cfg = load_config(ROOT / "configs" / "local-tiny.yaml")
    assert resolve_config(cfg) is cfg
    again = resolve_config(cfg, {"server.port": 31000})
    assert again.server.port == 31000 and again.target.checkpoint == cfg.target.checkpoint
    # The GPU-host lock is the machine's, whatever the label says: a safe name, never a path.
    name = host_limit_name(again)
    assert re.fullmatch(r"eyas-gpu-host-[a-z0-9-]+-[0-9a-f]{10}", name), name
    assert host_limit_name(resolve_config(cfg, {"server.host.name": "another-label"})) == name
    with pytest.raises(ConfigError, match="server.host.name"):  # and a path is no label at all
        resolve_config(cfg, {"server.host.name": "../../../etc/evil"})


def test_a_bad_override_names_the_field():
    with pytest.raises(ConfigError, match="training.max_steps"):
        resolve_config("configs/local-tiny.yaml", {"training.max_steps": -1})


def test_every_task_that_retries_asks_the_one_retry_condition():
    import importlib
    import pkgutil

    from prefect import Task

    import tasks
    from tasks.retry import worth_retrying

    retrying = [
        obj
        for info in pkgutil.iter_modules(tasks.__path__)
        for obj in vars(importlib.import_module(f"tasks.{info.name}")).values()
        if isinstance(obj, Task) and obj.retries
    ]
    assert (
        len(retrying) >= 6
    )  # regenerate, extract-shard, patch, unpatch, launch, stop, server-gone
    assert all(t.retry_condition_fn is worth_retrying for t in retrying), [t.name for t in retrying]


def test_the_core_command_line_has_no_run_and_the_eyas_script_adds_it(capsys):
    from eyas import cli as core
    from flows.runtime import cli

    with pytest.raises(SystemExit, match="`run` starts Prefect flows: use the `eyas` script"):
        core.main(["run", "configs/local-tiny.yaml"])
    assert (
        cli.main(
            [
                "check-config",
                str(ROOT / "configs" / "local-tiny.yaml"),
                "--set",
                "training.max_steps=9",
            ]
        )
        == 0
    )
    assert '"max_steps": 9' in capsys.readouterr().out  # a core command, handed over as it is
    with pytest.raises(SystemExit, match="--set expects key=value, got 'max_steps'"):
        cli.main(["check-config", str(ROOT / "configs" / "local-tiny.yaml"), "--set", "max_steps"])
