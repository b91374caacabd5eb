"""tasks/train.py: the acceptance evaluation is cached on the drafter's bytes and its settings."""

from eyas_prefect.tasks.train import evaluate_for
from prefect import flow

from tests.stage_config import stage_config


def test_evaluation_is_cached_on_the_drafters_bytes_and_refreshed_on_request(
    prefect_harness, exported_drafter, tmp_path
):
    target, drafter = exported_drafter
    cfg = stage_config(
        tmp_path,
        target,
        **{
            "evaluation.num_prompts": 2,
            "evaluation.max_new_tokens": 6,
            "evaluation.draft_steps": [2],
        },
    )
    prompts = [[5, 6, 7, 8, 9], [9, 10, 11, 12]]

    @flow
    def evaluate_once(cfg, drafter_dir: str):
        state = evaluate_for(cfg)(cfg, drafter_dir, prompts, return_state=True)
        return state.name, state.result()

    first_state, first = evaluate_once(cfg, str(drafter))
    again_state, again = evaluate_once(cfg, str(drafter))
    assert (first_state, again_state) == ("Completed", "Cached") and again == first
    other_state, _ = evaluate_once(
        cfg.model_copy(
            update={"evaluation": cfg.evaluation.model_copy(update={"max_new_tokens": 5})}
        ),
        str(drafter),
    )
    assert other_state == "Completed"  # other settings: evaluated
    refreshed_state, refreshed = evaluate_once(
        cfg.model_copy(update={"refresh": ["evaluate"]}), str(drafter)
    )
    assert (
        refreshed_state == "Completed" and refreshed.settings == first.settings
    )  # greedy: same figures

    # Another drafter (here: the same folder with one weight changed) is never served from the
    # cache.
    import shutil

    from safetensors.torch import load_file, save_file

    changed = tmp_path / "drafter-changed"
    shutil.copytree(drafter, changed)
    weights = load_file(changed / "model.safetensors")
    name = next(k for k in weights if k.endswith("fc.weight"))
    weights[name] = weights[name] * 0.5
    save_file(weights, changed / "model.safetensors")
    changed_state, _ = evaluate_once(cfg, str(changed))
    assert changed_state == "Completed"
