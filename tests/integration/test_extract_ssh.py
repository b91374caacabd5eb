"""Extraction when the orchestrator cannot see the node's dump folder: records come through the
host.

The node is a real sshd in its own mount namespace with a tmpfs over its dump folder (tests/sshd.py,
private_dirs): the server launched over SSH writes its records there, where only the SSH side sees
them, as a GPU node's /dev/shm is invisible to a Prefect worker on another machine.
"""

import os
import random
import shlex
import sys

import pytest
import torch

from eyas.config import HostConfig
from eyas.dump import DumpError, DumpWriter, read_records
from eyas.extraction import stage
from eyas.extraction.client import ServerPool
from eyas.extraction.data import TokenizedSample, write_shard_plans
from eyas.extraction.extract import extract_shard, shard_path
from eyas.extraction.records import DumpStore
from eyas.extraction.shards import ShardReader, verify_shard
from eyas.server import readiness
from eyas.server.launch import capture_launch, start_server, stop_server
from eyas.server.ssh_host import SSHHost
from tests.integration.test_lifecycle_ssh import ssh_stage_config
from tests.sshd import SSHD, can_unshare, start_sshd

pytestmark = pytest.mark.ssh

CAPTURE = [2, 4, 5]


@pytest.fixture(scope="module")
def node(tmp_path_factory):
    """An sshd whose sessions see a tmpfs at `node.private_dirs[0]` that this process does not."""
    if not os.path.exists(SSHD) or os.geteuid() != 0:
        pytest.skip("needs openssh-server and root (.ci/run installs it)")
    if not can_unshare():
        pytest.skip(
            "needs unshare --mount (root with CAP_SYS_ADMIN) for the node's private dump folder"
        )
    root = tmp_path_factory.mktemp("node")
    server = start_sshd(root / "sshd", private_dirs=[root / "node-only"])
    yield server
    server.process.terminate()
    server.process.wait(10)


def _host_cfg(sshd) -> HostConfig:
    return HostConfig(
        kind="ssh",
        name="loopback",
        hostname="127.0.0.1",
        port=sshd.port,
        user=sshd.user,
        key_filename=sshd.client_key,
        known_hosts=sshd.known_hosts,
        connect_timeout_s=5,
    )


def _on_node(host, path) -> list[str]:
    return host.run(f"ls -A {shlex.quote(str(path))}").stdout.split()


def test_extraction_collects_records_only_the_node_sees(tmp_path, node, random_target):
    dump = node.private_dirs[0] / "dump"
    cfg = ssh_stage_config(
        tmp_path,
        node,
        random_target,
        **{
            "server.dump_dir": str(dump),
            "extraction.record_timeout_s": 3,
            "extraction.collect_workers": 2,
        },
    )
    rng = random.Random(7)
    samples = []
    for _ in range(6):
        n = rng.randint(5, 40)  # chunked prefill of 16: most sequences are 2-3 records
        samples.append(
            TokenizedSample(
                [rng.randrange(3, 512) for _ in range(n)], [0] * (n // 2) + [1] * (n - n // 2)
            )
        )
    plan = write_shard_plans(samples, 1, tmp_path / "plan")[0]
    host = SSHHost(cfg.server.host)
    try:
        handle = start_server(host, capture_launch(cfg))
        pool = None
        try:
            readiness.wait_until_ready(
                host,
                log_path=handle.log_path,
                pid=handle.pid,
                url=handle.url,
                start_offset=handle.log_offset,
                poll_interval_s=0.1,
                stall_timeout_s=30,
                deadline_s=120,
                http_timeout_s=5,
            )
            # The node has its dump folder; this machine sees only the empty mount point.
            assert _on_node(host, dump) == [".eyas-owned"] and not dump.exists()
            pool = ServerPool(stage.endpoints(cfg), request_timeout_s=60, retries=1, backoff_s=0.1)
            manifest = extract_shard(
                plan,
                tmp_path / "out",
                capture_ids=CAPTURE,
                dtype="bfloat16",
                meta={"cache_key": "k"},
                pool=pool,
                record_timeout_s=3,
                collect_workers=2,
            )
            assert pool.endpoints[0].records.route == "host"
            assert _on_node(host, dump) == [
                ".eyas-owned"
            ]  # consumed records (and the probe) removed there
        finally:
            if pool is not None:
                pool.close()
            stop_server(host, capture_launch(cfg), handle)
    finally:
        host.close()
    path = shard_path(tmp_path / "out", plan)
    assert verify_shard(path)["num_samples"] == len(samples) == manifest["num_samples"]
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(
        random_target, dtype=torch.float32
    ).eval()
    for planned, got in zip(samples, ShardReader(path)):
        assert got.input_ids.tolist() == planned.input_ids
        with torch.no_grad():
            hs = model(torch.tensor([planned.input_ids]), output_hidden_states=True).hidden_states
        torch.testing.assert_close(
            got.aux_hidden_states.float(),
            torch.cat([hs[i][0] for i in CAPTURE], -1),
            atol=2e-2,
            rtol=2e-2,
        )


def _records(tmp_path, rid="eyas-x-a0"):
    local = tmp_path / "made-here"
    w = DumpWriter(local, layer_ids=CAPTURE)
    for a, n in ((0, 16), (16, 5)):
        w.write(rid, a, torch.arange(a, a + n), torch.randn(n, 3 * 8), torch.randn(n, 8))
    return local, rid


def test_store_reads_and_removes_through_the_host_what_only_the_node_sees(tmp_path, node):
    local, rid = _records(tmp_path)
    dump = node.private_dirs[0] / "store-test"
    host = SSHHost(_host_cfg(node))
    store = DumpStore(dump, _host_cfg(node))
    try:
        for f in sorted((local / rid).iterdir()):
            host.put(f, dump / rid / f.name)
        (
            local / rid / "0000000000.safetensors"
        ).unlink()  # the local copy can no longer stand in for it
        assert not dump.exists()
        records = store.read(rid)
        assert store.route == "host" and [r.prefix_offset for r in records] == [0, 16]
        assert torch.equal(records[1].token_ids, read_records(local, rid)[0].token_ids)
        assert _on_node(host, dump) == [rid]  # the route's probe left nothing behind
        # a damaged record on the node is refused by eyas.dump's reader, naming where it is
        host.run(f"truncate -s 100 {shlex.quote(str(dump / rid / '0000000016.safetensors'))}")
        with pytest.raises(DumpError, match=rf"cannot read loopback:{dump}/{rid}/0000000016"):
            store.read(rid)
        assert store.remove([rid, "eyas-x-a1"]) == 2 and _on_node(host, dump) == []
    finally:
        store.close()
        host.close()


def test_a_dump_folder_visible_here_is_read_here_though_its_host_is_ssh(tmp_path, sshd):
    local, rid = _records(tmp_path)
    store = DumpStore(local, _host_cfg(sshd))
    try:
        assert [r.prefix_offset for r in store.read(rid)] == [0, 16] and store.route == "local"
        assert sorted(p.name for p in local.iterdir()) == [rid]  # the probe was removed
        assert store.remove([rid]) == 2 and list(local.iterdir()) == []
    finally:
        store.close()


def test_the_local_host_never_probes(tmp_path):
    local, rid = _records(tmp_path)
    store = DumpStore(local, HostConfig())
    assert store.route == "local" and len(store.read(rid)) == 2


def test_preflight_says_which_way_the_records_will_come(tmp_path, node, sshd):
    from eyas.preflight import preflight
    from tests.tiny_config import TINY, tiny

    def notes(server, dump):
        host = _host_cfg(server).model_dump(mode="json")
        r = preflight(
            tiny(
                tmp_path,
                **{
                    "server.host": host,
                    "target.checkpoint": str(TINY),
                    "server.python": sys.executable,
                    "server.workdir": "/tmp/w",
                    "server.dump_dir": str(dump),
                },
            )
        )
        assert r.ok, r.problems
        return [n for n in r.notes if n.startswith("server.dump_dir=")]

    here = notes(sshd, tmp_path / "not-yet" / "dump")  # probed in its nearest existing folder
    assert len(here) == 1 and f"{tmp_path} on loopback is the same folder here" in here[0]
    there = notes(node, node.private_dirs[0] / "dump")
    assert (
        len(there) == 1
        and "not visible on this machine" in there[0]
        and "MB/s of records" in there[0]
    )
    assert list(tmp_path.glob("eyas-route-*")) == []
