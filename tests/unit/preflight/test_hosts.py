"""Host checks without a server: an SSH host nothing listens on is a problem naming its field, not a
crash (the checks against a real sshd are in tests/integration/test_preflight_hosts.py)."""

from __future__ import annotations

from eyas.preflight import preflight
from tests.tiny_config import TINY, fields, tiny


def test_unreachable_ssh_host_is_a_problem_not_a_crash(tmp_path, free_port):
    known = tmp_path / "known_hosts"
    known.write_text("")
    r = preflight(
        tiny(
            tmp_path,
            **{
                "server.backend": "sglang",
                "server.host": {
                    "kind": "ssh",
                    "hostname": "127.0.0.1",
                    "port": free_port,
                    "known_hosts": str(known),
                    "connect_timeout_s": 2,
                },
                "target.checkpoint": str(TINY),
                "server.workdir": "/tmp/w",
                "server.dump_dir": "/tmp/d",
            },
        )
    )
    assert fields(r) == ["server.host.hostname"] and "unreachable" in r.problems[0]


def test_a_missing_known_hosts_file_is_a_problem_naming_it_not_a_crash(tmp_path, free_port):
    missing = tmp_path / "no-such-known_hosts"
    r = preflight(
        tiny(
            tmp_path,
            **{
                "server.backend": "sglang",
                "server.host": {
                    "kind": "ssh",
                    "hostname": "127.0.0.1",
                    "port": free_port,
                    "known_hosts": str(missing),
                    "connect_timeout_s": 2,
                },
                "target.checkpoint": str(TINY),
                "server.workdir": "/tmp/w",
                "server.dump_dir": "/tmp/d",
            },
        )
    )
    assert fields(r) == ["server.host.known_hosts"], r.problems
    assert f"{missing} does not exist" in r.problems[0], r.problems
