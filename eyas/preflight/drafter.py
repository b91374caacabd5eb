"""The drafter training will build, checked against the target: draft vocabulary, positions, the
sizes training.drafter leaves to the target, and a warm start's source."""

from __future__ import annotations

from eyas.config import PipelineConfig


def planned_drafter(cfg: PipelineConfig, tcfg: dict, problems: list[str]):
    """The DrafterConfig training will build (eyas/training/train.py drafter_config), or None."""
    from eyas.training.train import drafter_config

    t, vocab = cfg.training, int(tcfg["vocab_size"])
    positions = tcfg.get("max_position_embeddings")
    if isinstance(positions, int) and cfg.data.max_length > positions:
        problems.append(
            f"data.max_length={cfg.data.max_length}: longer than the target's "
            f"max_position_embeddings ({positions})"
        )
    if t.draft_vocab_size > vocab:
        problems.append(
            f"training.draft_vocab_size={t.draft_vocab_size}: larger than the target's vocabulary "
            f"({vocab}, vocab_size in target.checkpoint's config)"
        )
        return None
    try:
        return drafter_config(t, tcfg, int(tcfg["hidden_size"]), len(cfg.target.layer_ids))
    except KeyError as e:
        problems.append(
            f"training.drafter: {e.args[0]} is not set and target.checkpoint's config has none"
        )
    except ValueError as e:
        problems.append(f"training.drafter={t.drafter.model_dump(exclude_none=True)}: {e}")
    return None


def warm_start_problems(cfg: PipelineConfig, dcfg) -> list[str]:
    """training.init_from: there, a drafter or checkpoint, of this run's sizes and capture
    layers."""
    from eyas.training.warm_start import init_problems, init_source

    try:
        source = init_source(cfg.training.init_from, cfg.training.output_dir)
        return init_problems(source, dcfg, cfg.target.capture_ids())
    except (ValueError, OSError, KeyError) as e:
        return [str(e)]
