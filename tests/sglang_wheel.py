"""The real sglang 0.5.23 wheel for tests: its files, a fake site-packages, a config serving it.

The wheel is fetched once with `pip download` into ~/.cache/eyas-test/wheels by the `sglang_wheel`
fixture (tests/conftest.py), which skips, saying why, when that fails.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from tests.stage_config import stage_config

VERSION = "0.5.23"
WHEEL_CACHE = Path.home() / ".cache" / "eyas-test" / "wheels"
DSV2 = "sglang/srt/models/deepseek_v2.py"


def wheel_text(wheel: Path, member: str) -> str:
    with zipfile.ZipFile(wheel) as z:
        return z.read(member).decode()


def make_site(root: Path, wheel: Path, version: str = VERSION) -> Path:
    """A site-packages holding sglang's deepseek_v2.py and dist-info (METADATA says `version`)."""
    site = root / "site-packages"
    with zipfile.ZipFile(wheel) as z:
        (site / DSV2).parent.mkdir(parents=True, exist_ok=True)
        (site / DSV2).write_bytes(z.read(DSV2))
        metadata = z.read(f"sglang-{VERSION}.dist-info/METADATA").decode()
    info = site / f"sglang-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(re.sub(r"(?m)^Version: .*$", f"Version: {version}", metadata))
    return site


TARGET_ARCH = "KimiK25ForConditionalGeneration"


def sglang_config(
    tmp: Path,
    site: Path,
    host: dict | None = None,
    architectures: list[str] | None = (TARGET_ARCH,),
    capture: str = "source_patch",
):
    """A config serving `<tmp>/checkpoint`, whose config.json names `architectures` (None: no file).

    `capture` is server.capture: these tests exercise the source patch unless they ask for the
    forward hook alone (the config default)."""
    overrides = {
        "server.backend": "sglang",
        "server.python": sys.executable,
        "server.env": {"PYTHONPATH": str(site)},
        "server.capture": capture,
    }
    if host is not None:
        overrides["server.host"] = host
    checkpoint = tmp / "checkpoint"
    checkpoint.mkdir(parents=True, exist_ok=True)
    if architectures is not None:
        (checkpoint / "config.json").write_text(json.dumps({"architectures": list(architectures)}))
    return stage_config(tmp, checkpoint, **overrides)


def download_wheel(version: str = VERSION) -> Path:
    """The sglang wheel of `version`, downloaded once per machine with pip (skips if that fails)."""
    found = sorted(WHEEL_CACHE.glob(f"sglang-{version}-*.whl"))
    if not found:
        WHEEL_CACHE.mkdir(parents=True, exist_ok=True)
        cmd = [
            sys.executable,
            "-m",
            "pip",
            "download",
            f"sglang=={version}",
            "--no-deps",
            "-d",
            str(WHEEL_CACHE),
        ]
        try:
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=900, check=False)
            why = f"exit {r.returncode}: {(r.stderr or r.stdout).strip()[-300:]}"
        except (OSError, subprocess.TimeoutExpired) as e:
            why = f"{type(e).__name__}: {e}"
        found = sorted(WHEEL_CACHE.glob(f"sglang-{version}-*.whl"))
        if not found:
            pytest.skip(
                f"`pip download sglang=={version} --no-deps` failed ({why}); put the wheel "
                f"in {WHEEL_CACHE} to run this test"
            )
    return found[0]
