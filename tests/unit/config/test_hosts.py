"""The host a server runs on: an SSH host needs a hostname and a way to check its key."""

from __future__ import annotations

import pytest

from eyas.config import HostConfig


def test_ssh_config_requires_known_hosts():
    with pytest.raises(ValueError, match="known_hosts"):
        HostConfig(kind="ssh", hostname="gpu-node-1")
