"""eyas preflight measures server.dump_dir on the server host over SSH (a real OpenSSH server,
tests/sshd.py): the folder, its free bytes and what the capture needs are named when it is too
small, and a host that cannot be reached is reported once, by the host check."""

from __future__ import annotations

import re
import uuid

import pytest

from eyas.preflight import preflight
from eyas.preflight.dump_dir import dump_bytes_needed
from tests.sshd import sglang_stand_in, ssh_host_fields
from tests.tiny_config import TINY, fields, tiny

pytestmark = pytest.mark.ssh


def _ssh_config(tmp_path, sshd, **overrides):
    stand_in = sglang_stand_in(tmp_path)
    host = ssh_host_fields(sshd)
    return tiny(
        tmp_path,
        **{
            "server.backend": "sglang",
            "server.host": host,
            "target.checkpoint": str(TINY),
            "server.workdir": "/tmp/w",
            "server.python": str(stand_in),
            **overrides,
        },
    )


def test_the_dump_dirs_filesystem_is_measured_on_the_host_over_ssh(tmp_path, sshd):
    # a folder only the host is asked about: its nearest existing parent there is /dev/shm
    dump = f"/dev/shm/eyas-preflight-{uuid.uuid4().hex[:8]}/dump"
    r = preflight(_ssh_config(tmp_path, sshd, **{"server.dump_dir": dump}))
    assert r.ok, r.problems
    cfg = _ssh_config(tmp_path, sshd, **{"server.dump_dir": dump, "extraction.concurrency": 10**6})
    r = preflight(cfg)
    assert fields(r) == ["server.dump_dir"]
    need, _, _ = dump_bytes_needed(cfg, 256)
    problem = r.problems[0]
    assert problem.startswith(f"server.dump_dir={dump}: /dev/shm on loopback has ")
    free = int(re.search(r"has ([\d,]+) bytes", problem)[1].replace(",", ""))
    assert 0 < free < need and f"{need:,} bytes" in problem
    # skipped, and said so, when the host checks are
    r = preflight(cfg, check_hosts=False)
    assert r.ok and any(n.startswith(f"server.dump_dir={dump}: free space") for n in r.notes)


def test_an_unknown_host_key_is_reported_once(tmp_path, sshd):
    unknown = tmp_path / "empty_known_hosts"
    unknown.write_text("")
    cfg = _ssh_config(tmp_path, sshd, **{"server.dump_dir": "/dev/shm/eyas-x"})
    host = {**cfg.server.host.model_dump(mode="json"), "known_hosts": str(unknown)}
    r = preflight(
        _ssh_config(tmp_path, sshd, **{"server.dump_dir": "/dev/shm/eyas-x", "server.host": host})
    )
    assert fields(r) == ["server.host.hostname"]
