"""Where the collector reads dump records: a folder of this machine is read here, and the probe that
decides it for an SSH host leaves nothing behind (over a real sshd:
tests/integration/test_extract_ssh.py)."""

from __future__ import annotations

from eyas.config import HostConfig
from eyas.extraction.records import DumpStore, probe_visible
from eyas.server.hosts import LocalHost


def test_a_probe_finds_the_nearest_existing_folder_and_removes_itself(tmp_path):
    visible, folder = probe_visible(LocalHost(), tmp_path / "not" / "yet")
    assert visible and folder == str(tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_a_local_store_reads_here_without_a_probe(tmp_path):
    store = DumpStore(tmp_path, HostConfig(name="here"))
    assert store.route == "local" and store.host_cfg is None
    assert store.read("no-such-rid") == []
