"""The serving benchmark's cache key: what makes a re-run measure again."""

from eyas_prefect.tasks.serve_bench import _serving_key

from tests.stage_config import ROOT, stage_config

TARGET = ROOT / "fixtures" / "tiny-target"
PROMPTS = [[5, 6, 7, 8], [9, 10, 11]]


def test_the_key_changes_with_the_prompts_the_chains_and_the_drafters_bytes(tmp_path):
    drafter = tmp_path / "drafter"
    drafter.mkdir()
    (drafter / "config.json").write_text("{}")
    (drafter / "model.safetensors").write_bytes(b"weights")
    cfg = stage_config(tmp_path, TARGET, **{"evaluation.draft_steps": [3]})

    def key(cfg=cfg, prompts=PROMPTS, source="given") -> str:
        sets = {"heldout": {"prompts": prompts, "source": source}}
        return _serving_key(None, {"cfg": cfg, "drafter_dir": str(drafter), "sets": sets})

    first = key()
    assert key() == first  # a re-run: the cached figures
    assert key(cfg=stage_config(tmp_path, TARGET, **{"evaluation.draft_steps": [3]})) == first
    assert key(prompts=PROMPTS[:1]) != first  # other prompts
    assert key(source="other") != first
    assert key(cfg=stage_config(tmp_path, TARGET, **{"evaluation.draft_steps": [3, 2]})) != first
    assert key(cfg=stage_config(tmp_path, TARGET, **{"benchmark.max_new_tokens": 7})) != first
    (drafter / "model.safetensors").write_bytes(b"other weights")
    assert key() != first  # another drafter
