"""eyas preflight's host checks through a real OpenSSH server (tests/sshd.py): the SGLang version
asked through the Host seam, and an unknown host key or a refused key reported as problems, not
crashes."""

from __future__ import annotations

import sys

import pytest

from eyas.preflight import preflight
from tests.sshd import sglang_stand_in, ssh_host_fields
from tests.tiny_config import TINY, fields, tiny

pytestmark = pytest.mark.ssh


def test_ssh_host_key_and_sglang_version_through_a_real_sshd(tmp_path, sshd):
    stand_in = sglang_stand_in(tmp_path)
    host = ssh_host_fields(sshd)
    base = {
        "server.backend": "sglang",
        "server.host": host,
        "target.checkpoint": str(TINY),
        "server.workdir": "/tmp/w",
        "server.dump_dir": "/tmp/d",
        "server.python": str(stand_in),
    }
    assert preflight(tiny(tmp_path, **base)).ok
    r = preflight(tiny(tmp_path, **{**base, "server.python": sys.executable}))  # no sglang there
    assert fields(r) == ["server.python"] and "PackageNotFoundError" in r.problems[0]
    unknown = tmp_path / "empty_known_hosts"
    unknown.write_text("")
    r = preflight(tiny(tmp_path, **{**base, "server.host": {**host, "known_hosts": str(unknown)}}))
    assert fields(r) == ["server.host.hostname"] and "server.host.known_hosts" in r.problems[0]
    r = preflight(
        tiny(tmp_path, **{**base, "server.host": {**host, "key_filename": str(sshd.other_key)}})
    )
    assert fields(r) == ["server.host.hostname"] and "refused" in r.problems[0]
