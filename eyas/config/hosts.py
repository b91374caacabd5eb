"""A host section: this machine, or a GPU host reached over SSH (server.host, the training hosts,
an endpoint's host)."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, model_validator

from eyas.config.base import Address, StrictModel


class HostConfig(StrictModel):
    """Where the server runs: this machine, or a GPU host reached over SSH (Fabric)."""

    kind: Literal["local", "ssh"] = "local"
    name: str = Field(
        "localhost", pattern=r"^[A-Za-z0-9_.-]+$"
    )  #: a label for run names, logs, locks: gpu-node-1
    hostname: Address | None = None  #: SSH only
    port: int = 22
    user: str | None = None
    key_filename: Path | None = None
    known_hosts: Path | None = None  #: host keys are checked against this file; it must exist
    #: Fabric trusts any host key by default; eyas does not. True accepts hosts known_hosts does not
    #: list, with a warning at every connection; a key that contradicts known_hosts is still
    #: refused.
    insecure_accept_any_host_key: bool = False
    connect_timeout_s: float = Field(10.0, gt=0)

    @model_validator(mode="after")
    def _check_ssh(self) -> "HostConfig":
        if self.kind == "ssh":
            if not self.hostname:
                raise ValueError("an ssh host needs hostname")
            if self.known_hosts is None and not self.insecure_accept_any_host_key:
                raise ValueError(
                    "an ssh host needs known_hosts (or insecure_accept_any_host_key: true)"
                )
        return self
