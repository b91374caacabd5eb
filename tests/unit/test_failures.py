"""flows/failures.py without a Prefect server: the one log filter, a reason as one line."""

import logging
import sys

from eyas_prefect.flows import failures

from eyas.errors import InvalidInput


def record_of(
    exc: BaseException, msg: str = "Task run failed with exception: %r"
) -> logging.LogRecord:
    try:
        raise exc
    except BaseException:
        info = sys.exc_info()
    return logging.LogRecord("prefect.task_runs", logging.ERROR, __file__, 1, msg, (exc,), info)


def test_an_eyas_error_loses_its_traceback_and_keeps_its_message_and_level():
    record = record_of(InvalidInput("data.path /x: no such file"))
    message = record.getMessage()
    assert failures.EyasTracebackFilter().filter(record) is True
    assert record.exc_info is None and record.exc_text is None
    assert record.getMessage() == message and record.levelno == logging.ERROR
    assert "Traceback" not in logging.Formatter().format(record)


def test_a_bug_keeps_its_traceback():
    record = record_of(ValueError("a bug"))
    assert failures.EyasTracebackFilter().filter(record) is True
    assert record.exc_info is not None and record.exc_info[0] is ValueError
    assert "Traceback" in logging.Formatter().format(record)


def test_the_filter_sits_on_prefects_run_loggers_once():
    failures.install()
    failures.install()
    for name in failures.LOGGERS:
        mine = [
            f
            for f in logging.getLogger(name).filters
            if isinstance(f, failures.EyasTracebackFilter)
        ]
        assert len(mine) == 1, name


def test_a_reason_is_one_line_with_the_type_of_a_bug_only():
    assert failures.reason_of(InvalidInput("a\n  b")) == "a; b"
    assert failures.reason_of(ValueError("x")) == "ValueError: x"
    assert failures.reason_of(KeyError()) == "KeyError: KeyError"


def test_a_subflows_line_passes_up_as_it_is():
    line = failures.failure_line(RuntimeError("failed at t: why\nmore"), "extract", None)
    assert line == "failed at t: why"
    assert failures.failure_line(InvalidInput("why"), "extract", None) == "failed at extract: why"
