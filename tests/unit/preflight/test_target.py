"""The target's checks: target.layer_ids in the capture convention, and the architecture against
what server.backend serves (the patch set's list for SGLang)."""

from __future__ import annotations

import json
import shutil

import pytest

from eyas.config import TargetConfig
from eyas.preflight import preflight
from eyas.preflight.target import layer_id_problems
from tests.stage_config import ROOT
from tests.tiny_config import TINY, fields, tiny


def test_layer_id_50_passes_check_config_but_not_preflight(tmp_path):
    cfg = tiny(
        tmp_path, **{"target.layer_ids": [2, 4, 50]}
    )  # load_config (check-config) accepts it
    r = preflight(cfg)
    assert fields(r) == ["target.layer_ids"]
    assert (
        "[50] out of range for the target's 8 layers" in r.problems[0] and "1 to 7" in r.problems[0]
    )


@pytest.mark.parametrize(
    "ids, convention, expect",
    [
        ([2, 4, 5], "capture-before", None),
        ([1, 3, 4], "output-of", None),  # capture [2, 4, 5]
        ([1, 4, 5], "capture-before", "shifted to [2, 5, 6]"),
        ([2, 4, 7], "output-of", "[8] out of range"),  # 7's output is the final norm's input
        ([0, 4, 5], "capture-before", "[0] out of range"),
        ([2, 4], "capture-before", "exactly 3 layers"),
    ],
)
def test_layer_ids_in_the_capture_convention(ids, convention, expect):
    found = layer_id_problems(
        TargetConfig(checkpoint=TINY, layer_ids=ids, layer_convention=convention), 8
    )
    assert (found == []) if expect is None else (len(found) == 1 and expect in found[0]), found


def test_unknown_architecture_is_refused_naming_it(tmp_path):
    target = tmp_path / "target"
    shutil.copytree(TINY, target, ignore=shutil.ignore_patterns("*.safetensors"))
    raw = json.loads((target / "config.json").read_text())
    (target / "config.json").write_text(
        json.dumps({**raw, "architectures": ["MixtralForCausalLM"]})
    )
    r = preflight(tiny(tmp_path, **{"target.checkpoint": str(target)}))
    assert fields(r) == ["target.checkpoint"]
    assert "['MixtralForCausalLM']" in r.problems[0] and "server.backend=local" in r.problems[0]
    sglang = preflight(
        tiny(tmp_path, **{"target.checkpoint": str(target), "server.backend": "sglang"})
    )
    assert (
        "KimiK25ForConditionalGeneration" in sglang.problems[0]
    )  # the supported list, from the patch set


def test_the_patch_sets_architectures_key_is_read(tmp_path):
    patches = tmp_path / "patches"
    shutil.copytree(ROOT / "patches" / "sglang", patches)
    manifest = patches / "0.5.23" / "manifest.json"
    manifest.write_text(
        json.dumps({**json.loads(manifest.read_text()), "architectures": ["LlamaForCausalLM"]})
    )
    r = preflight(tiny(tmp_path, **{"server.backend": "sglang"}), patches_dir=patches)
    assert fields(r) == ["target.checkpoint"] and "supported: LlamaForCausalLM" in r.problems[0]
    assert "architecture DeepseekV3ForCausalLM is not supported" in r.problems[0]
