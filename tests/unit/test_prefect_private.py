"""The private Prefect names eyas uses (flows/runtime/prefect_private.py) exist in the installed
Prefect, whose minor version is one they were read in: an upgrade that moves them fails here, not
silently in a run."""

import importlib

import prefect
from eyas_prefect.flows.runtime.prefect_private import (
    TESTED_MINORS,
    cancel_requested,
    tested_version,
)


def test_the_installed_prefect_is_a_tested_minor_version():
    assert tested_version(), (
        f"prefect {prefect.__version__}: read flows/runtime/prefect_private.py again"
    )
    assert tested_version("3.9.7") and not tested_version("3.10.0") and TESTED_MINORS == ("3.9",)


def test_every_private_name_used_is_there():
    services = importlib.import_module("prefect._internal.concurrency.services")
    assert callable(services._QueueServiceBase.drain_all)
    listener = importlib.import_module("prefect._internal.control_listener")
    assert callable(listener.get_intent)
    assert cancel_requested() is False  # no runner told this process anything


def test_no_other_module_reaches_into_prefect_internals():
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    users = sorted(
        str(p.relative_to(root))
        for folder in ("eyas", "flows", "tasks")
        for p in (root / folder).rglob("*.py")
        if "prefect._internal" in p.read_text() or "_QueueServiceBase" in p.read_text()
    )
    assert users == ["flows/runtime/prefect_private.py"]
