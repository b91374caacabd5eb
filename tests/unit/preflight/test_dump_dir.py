"""server.dump_dir's filesystem measured on the server host (here a local one, with the real
/dev/shm) against the dump records extraction keeps there. The SSH form is in
tests/integration/test_preflight_dump_dir.py."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from eyas.config import load_config
from eyas.preflight import preflight
from eyas.preflight.dump_dir import SHARDS_AT_ONCE, dump_bytes_needed
from tests.stage_config import ROOT
from tests.tiny_config import fields, tiny


def test_the_dump_bytes_extraction_keeps_at_once():
    cfg = load_config(ROOT / "configs" / "kimi-k2.5-sglang.yaml", {"data.max_length": 4096})
    need, sequences, per_token = dump_bytes_needed(cfg, 7168)
    assert per_token == 4 * 7168 * 2 + 4  # 3 aux layers + the last in bf16, an int32 id
    assert 4096 * per_token == pytest.approx(235e6, rel=0.001)  # one 4k-token sequence: ~235 MB
    x = cfg.extraction
    assert sequences == x.concurrency + SHARDS_AT_ONCE * x.collect_workers == 12
    assert need == sequences * 4096 * per_token


SHM = Path("/dev/shm")


@pytest.mark.skipif(not SHM.is_dir(), reason="no /dev/shm on this machine")
def test_a_dump_dir_too_small_for_the_capture_is_refused_naming_folder_free_bytes_and_need(
    tmp_path,
):
    dump = (
        SHM / f"eyas-test-{tmp_path.name}" / "dump"
    )  # not created: its nearest existing parent is measured
    ok = preflight(tiny(tmp_path, **{"server.dump_dir": str(dump)}))
    assert "server.dump_dir" not in fields(ok)
    cfg = tiny(tmp_path, **{"server.dump_dir": str(dump), "extraction.concurrency": 10**6})
    r = preflight(cfg)
    assert fields(r) == ["server.dump_dir"]
    need, _, _ = dump_bytes_needed(cfg, 256)
    problem = r.problems[0]
    assert f"{SHM} on localhost has " in problem and f"{need:,} bytes" in problem
    free = int(re.search(r"has ([\d,]+) bytes", problem)[1].replace(",", ""))
    assert 0 < free < need and "extraction.concurrency=1000000" in problem
    assert "--shm-size" in problem  # bigger than the filesystem itself: the container's flag
