"""The flows' config parameter: a YAML path, an inline mapping, or a loaded config, plus
overrides."""

import logging
import re
import uuid

import pytest
import yaml
from eyas_prefect.flows.common import ROOT, resolve_config
from eyas_prefect.flows.runtime.host_lock import host_limit_name

from eyas.config import ConfigError, load_config


def test_a_path_is_taken_from_the_repository_root_wherever_the_run_starts(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg = resolve_config("configs/local-tiny.yaml", {"training.max_steps": 20})
    assert cfg == load_config(ROOT / "configs" / "local-tiny.yaml", {"training.max_steps": 20})
    assert (
        cfg.training.max_steps == 20 and cfg.target.checkpoint == ROOT / "fixtures" / "tiny-target"
    )


def test_an_inline_mapping_means_what_the_config_file_it_was_pasted_from_means():
    """Relative paths of an inline config are taken from configs/, as in a file there: the docs'
    inline trigger pastes configs/local-tiny.yaml as it is."""
    raw = yaml.safe_load((ROOT / "configs" / "local-tiny.yaml").read_text())
    assert raw["target"]["checkpoint"].startswith("../")
    cfg = resolve_config(raw, {"training.max_steps": 20})
    assert cfg == load_config(ROOT / "configs" / "local-tiny.yaml", {"training.max_steps": 20})
    assert cfg.target.checkpoint == ROOT / "fixtures" / "tiny-target"
    assert resolve_config({**raw, "run_dir": "runs/x"}).run_dir == ROOT / "configs" / "runs" / "x"


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

    import eyas_prefect.tasks as tasks
    from eyas_prefect.tasks.retry import worth_retrying
    from prefect import Task

    retrying = [
        obj
        for info in pkgutil.iter_modules(tasks.__path__)
        for obj in vars(importlib.import_module(f"eyas_prefect.tasks.{info.name}")).values()
        if isinstance(obj, Task) and obj.retries
    ]
    assert (
        len(retrying) >= 6
    )  # regenerate, extract-shard, patch, unpatch, launch, stop, server-gone
    assert all(t.retry_condition_fn is worth_retrying for t in retrying), [t.name for t in retrying]


def test_the_core_command_line_has_no_run_and_the_eyas_script_adds_it(capsys):
    from eyas_prefect.flows.runtime import cli

    from eyas import cli as core

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


def test_the_stop_hook_says_what_it_did_in_sentences():
    from eyas_prefect.flows.common import stop_sentence

    level, line = stop_sentence(
        {"pid": 41, "outcome": "terminated", "dump_dir": "removed"}, "gpu-1", "the server"
    )
    assert level == logging.WARNING and line == (
        "stopped the server it launched on gpu-1 (pid 41, terminated); its dump folder: removed"
    )
    assert stop_sentence({"pid": None, "outcome": "not running", "dump_dir": "kept"}, "h") == (
        logging.INFO,
        "it launched no server on h: nothing to stop",
    )
    bench = "the benchmark server spec-3-1-4 (sglang)"
    assert stop_sentence({"pid": None, "outcome": "not running"}, "h", bench)[1] == ""
    assert stop_sentence({"pid": 9, "outcome": "terminated"}, "h", bench) == (
        logging.WARNING,
        "stopped the benchmark server spec-3-1-4 (sglang) it launched on h (pid 9, terminated)",
    )
    left = {"pid": 7, "outcome": "left alone: launched by flow run abc, not by this run"}
    assert stop_sentence(left, "h")[1] == (
        "the server on h (pid 7) was left alone: launched by flow run abc, not by this run"
    )
    assert stop_sentence(left, "h", bench)[1] == ""
    for line in (stop_sentence(o, "h")[1] for o in ({"pid": 3, "outcome": "killed"},)):
        assert "{" not in line and "'" not in line, line


def test_the_stop_hook_names_each_benchmark_server_by_its_label_and_backend(tmp_path):
    from eyas_prefect.flows.common import server_words

    from eyas.evaluation import serve_bench
    from eyas.server.launch import capture_launch
    from tests.stage_config import stage_config

    cfg = stage_config(tmp_path, ROOT / "fixtures" / "tiny-target", **{"benchmark.enabled": True})
    words = [server_words(launched) for launched in serve_bench.launches(cfg)]
    assert server_words(capture_launch(cfg)) == "the server"
    assert words[0] == "the benchmark server plain (local)" and len(set(words)) == len(words) > 1
    assert all(w.startswith("the benchmark server spec-") for w in words[1:]), words


def test_the_stop_hook_never_raises_and_logs_why_it_could_not_stop(tmp_path):
    """An SSH host whose known_hosts file is missing (HostConfigError): one error line naming the
    host and the way out, no exception out of the hook."""
    from eyas_prefect.flows.common import stop_server_hook
    from prefect.client.schemas.objects import FlowRun, State, StateType

    overrides = {
        "server.host": {
            "kind": "ssh",
            "name": "gpu-9",
            "hostname": "127.0.0.1",
            "user": "nobody",
            "known_hosts": str(tmp_path / "missing_known_hosts"),
        },
        "target.checkpoint": str(ROOT / "fixtures" / "tiny-target"),
        "server.workdir": str(tmp_path / "server"),
        "server.dump_dir": str(tmp_path / "server" / "dump"),
    }
    run = FlowRun(
        flow_id=uuid.uuid4(),
        name="r",
        parameters={"config": "configs/local-tiny.yaml", "overrides": overrides},
    )
    records: list[logging.LogRecord] = []
    handler = logging.Handler(logging.INFO)
    handler.emit = records.append
    logger = logging.getLogger("prefect.flow_runs")  # Prefect's run loggers do not propagate
    logger.addHandler(handler)
    try:
        stop_server_hook(None, run, State(type=StateType.FAILED, name="Failed"))
    finally:
        logger.removeHandler(handler)
    errors = [r.getMessage() for r in records if r.levelno >= logging.ERROR]
    assert len(errors) == 1 and errors[0].startswith("run Failed: could not reach gpu-9"), errors
    assert "eyas stop" in errors[0] and not any(r.exc_info for r in records)
