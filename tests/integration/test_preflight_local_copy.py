"""preflight's check of the orchestrator's copy of the target (target.local_dir) against the
checkpoint the server loads, read on the server host through a real OpenSSH server (tests/sshd.py):
the same architectures, hidden size, layers and vocabulary, or a problem naming what differs."""

from __future__ import annotations

import json
import shutil

import pytest

from eyas.preflight import preflight
from tests.sshd import sglang_stand_in, ssh_host_fields
from tests.tiny_config import TINY, fields, tiny

pytestmark = pytest.mark.ssh


def small_files(src, dst, **changes):
    dst.mkdir()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(src / name, dst)
    if changes:
        (dst / "config.json").write_text(
            json.dumps({**json.loads((dst / "config.json").read_text()), **changes})
        )
    return dst


def test_the_local_copy_is_checked_against_the_checkpoint_on_the_host(tmp_path, sshd):
    stand_in = sglang_stand_in(tmp_path)
    host = ssh_host_fields(sshd)
    node = (
        tmp_path / "node"
    )  # the checkpoint's folder "on the node" (the loopback sshd's filesystem)
    node.mkdir()
    shutil.copy(TINY / "config.json", node)
    copy = small_files(TINY, tmp_path / "copy")
    base = {
        "server.backend": "sglang",
        "evaluation.method": "server",
        "server.host": host,
        "target.checkpoint": str(node),
        "target.local_dir": str(copy),
        "server.workdir": "/tmp/w",
        "server.dump_dir": "/tmp/d",
        "server.python": str(stand_in),
    }
    r = preflight(tiny(tmp_path, **base))
    assert r.ok, r.problems

    (node / "config.json").write_text(
        json.dumps(
            {
                **json.loads((TINY / "config.json").read_text()),
                "hidden_size": 512,
                "num_hidden_layers": 12,
            }
        )
    )
    r = preflight(tiny(tmp_path, **base))
    assert fields(r) == ["target.local_dir"]
    assert "hidden_size 256 here, 512 there; num_hidden_layers 8 here, 12 there" in r.problems[0]
    assert f"target.checkpoint={node} on 127.0.0.1" in r.problems[0]

    (node / "config.json").unlink()
    r = preflight(tiny(tmp_path, **base))
    assert (
        fields(r) == ["target.checkpoint"] and "no config.json there on 127.0.0.1" in r.problems[0]
    )

    r = preflight(tiny(tmp_path, **base), check_hosts=False)  # the host is not asked
    assert r.ok, r.problems
