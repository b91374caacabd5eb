"""Prefect tasks over the eyas core. eyas's own log records (the SSH host-key warnings of
eyas/server/hosts.py, say) reach the run's log in the UI through Prefect's handlers, as if
PREFECT_LOGGING_EXTRA_LOGGERS named "eyas"."""

import logging

import prefect  # noqa: F401 - importing Prefect sets up its logging handlers

_eyas = logging.getLogger("eyas")
for _handler in logging.getLogger("prefect.extra").handlers:
    if _handler not in _eyas.handlers:
        _eyas.addHandler(_handler)
