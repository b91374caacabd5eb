"""`pip install eyas` without -e: the wheel carries the patch sets, example configs and tiny target,
and the installed package finds them with no repository in sight."""

import shutil
import subprocess
import sys
import zipfile

import pytest

from tests.stage_config import ROOT


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("wheel")
    # A copy of the checkout: setuptools builds in the source tree, and the checkout stays clean.
    src = tmp / "src"
    shutil.copytree(
        ROOT,
        src,
        ignore=shutil.ignore_patterns(
            ".git", ".venv", "runs", "build", "*.egg-info", "__pycache__", ".pytest_cache"
        ),
    )
    built = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "-q",
            "--no-deps",
            "--no-build-isolation",
            "-w",
            str(tmp / "dist"),
            str(src),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert built.returncode == 0, built.stderr[-2000:]
    wheel = next((tmp / "dist").glob("eyas-*.whl"))
    site = tmp / "site"
    with zipfile.ZipFile(wheel) as z:  # a wheel is a zip laid out as site-packages
        z.extractall(site)
    return wheel, site


def test_the_wheel_holds_the_code_and_the_shipped_files(installed):
    wheel, _ = installed
    names = set(zipfile.ZipFile(wheel).namelist())
    for path in (
        "eyas/training/train.py",
        "eyas/extraction/stage.py",
        "eyas_prefect/tasks/extract.py",
        "eyas_prefect/flows/pipeline.py",
        "eyas_prefect/flows/runtime/cli.py",  # the `eyas` script's entry point
        "eyas/_shipped/patches/sglang/0.5.23/manifest.json",
        "eyas/_shipped/patches/sglang/eyas_sglang_hook.py",
        "eyas/_shipped/configs/local-tiny.yaml",
        "eyas/_shipped/configs/kimi-k2.5-sglang.yaml",
        "eyas/_shipped/patches/sglang/0.5.18/manifest.json",
        "eyas/_shipped/fixtures/tiny-target/config.json",
    ):
        assert path in names, path
    # the Prefect layer only under the project's namespace: no top-level `flows` or `tasks`
    assert not [n for n in names if n.split("/")[0] in ("flows", "tasks")]
    # the real-SGLang tier's target stays in the repository
    assert not [n for n in names if n.startswith("eyas/_shipped/fixtures/tiny-target-cpu/")]


def test_the_installed_package_finds_its_files_away_from_the_checkout(installed, tmp_path):
    _, site = installed
    script = (
        "import importlib.util, json, eyas\nfrom eyas.resources import shipped, shipped_root\n"
        "from eyas.server.patch_sets import available_versions, load_patch_set\n"
        "from eyas.config import load_config\n"
        "cfg = load_config(shipped('configs', 'local-tiny.yaml'))\n"
        "print(json.dumps({'eyas': eyas.__file__, 'root': str(shipped_root()),\n"
        "                  'versions': available_versions(), 'patch': "
        "load_patch_set('0.5.23').patch_version,\n"
        "                  'target': str(cfg.target.checkpoint), 'target_ok': "
        "(cfg.target.checkpoint / 'config.json').exists(),\n"
        "                  'flows': "
        "importlib.util.find_spec('eyas_prefect.flows.pipeline').origin}))\n"
    )
    env = {"PYTHONPATH": str(site), "PATH": "/usr/bin:/bin", "HOME": str(tmp_path)}
    out = subprocess.run(
        [sys.executable, "-c", script],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    import json

    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["eyas"].startswith(str(site)) and got["root"] == str(site / "eyas" / "_shipped")
    assert got["versions"] == ["0.5.18", "0.5.23"] and got["patch"].startswith(
        "eyas-sglang-0.5.23-"
    )
    assert got["target"].startswith(str(site)) and got["target_ok"]
    assert got["flows"] == str(site / "eyas_prefect" / "flows" / "pipeline.py")
