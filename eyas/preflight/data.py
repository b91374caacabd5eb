"""The data side: the tokenizer loaded as prepare-data loads it, the chat template, and data.path
counted with prepare's own reader."""

from __future__ import annotations

import json
from pathlib import Path

from eyas.config import PipelineConfig
from eyas.plan import DataCount, count_tokens


def _tokenizer_field(cfg: PipelineConfig) -> str:
    t = cfg.target
    return (
        f"target.local_dir={t.local_dir}"
        if t.local_dir is not None
        else f"target.local_dir=None (target.checkpoint={t.checkpoint})"
    )


def has_chat_template(folder: Path) -> bool:
    """tokenizer_config.json's chat_template, or a chat_template.jinja beside it."""
    if (folder / "chat_template.jinja").is_file():
        return True
    try:
        return bool(json.loads((folder / "tokenizer_config.json").read_text()).get("chat_template"))
    except (OSError, ValueError):
        return False


def checked_tokenizer(
    cfg: PipelineConfig, notes: list[str], check: bool
) -> tuple[object | None, list[str]]:
    """(the tokenizer loaded as prepare loads it or None, its problems): the problems count only
    when the data has conversations (a pre-tokenized file needs neither tokenizer nor template)."""
    from eyas.target import local_copy

    folder = local_copy(cfg.target)
    where = _tokenizer_field(cfg)
    pending = []
    if (
        not (folder / "tokenizer_config.json").is_file()
        and not (folder / "tokenizer.json").is_file()
    ):
        pending.append(f"{where}: no tokenizer_config.json or tokenizer.json in {folder}")
    elif not has_chat_template(folder):
        pending.append(
            f"{where}: no chat template in {folder} (tokenizer_config.json chat_template or "
            f"chat_template.jinja); conversations cannot be rendered or masked without one"
        )
    tok = None
    if not pending and check:
        from eyas.target import RemoteCodeRefused, load_tokenizer, trust_remote_code

        trust = trust_remote_code(cfg.target, cfg.server.backend)
        try:
            tok = load_tokenizer(folder, trust_remote_code=trust)
        except RemoteCodeRefused as e:
            pending.append(
                f"target.trust_remote_code={cfg.target.trust_remote_code} (server.backend="
                f"{cfg.server.backend}): {e}"
            )
        except Exception as e:  # noqa: BLE001 - whatever transformers raises, prepare-data would too
            pending.append(
                f"{where}: the tokenizer does not load as prepare-data loads it "
                f"(eyas/target.py load_tokenizer): {type(e).__name__}: "
                f"{' '.join(str(e).split())[:400]}"
            )
    elif not pending:
        notes.append(
            f"tokenizer not loaded (check_tokenizer=False): {folder} has its files and a chat "
            f"template; tokens are estimated"
        )
    return tok, pending


def count_data(
    cfg: PipelineConfig,
    tokenizer,
    tcfg: dict | None,
    problems: list[str],
    pending: list[str],
    small_bytes: int,
) -> DataCount | None:
    vocab = int(tcfg["vocab_size"]) if tcfg is not None else None
    try:
        count = count_tokens(cfg.data, tokenizer, vocab_size=vocab, small_bytes=small_bytes)
    except Exception as e:  # noqa: BLE001 - DataError, or a template that fails on a record
        problems += pending  # unknown content: assume conversations
        problems.append(f"data.path={cfg.data.path}: {e}")
        return None
    if count.conversations:
        problems += pending
    if count.bad_lines and cfg.data.bad_lines == "error":
        problems.append(bad_lines_message(cfg, count.bad_lines))
    return count


MAX_LISTED_BAD_LINES = 20


def bad_lines_message(cfg: PipelineConfig, bad: tuple[str, ...] | list[str]) -> str:
    """Every bad line of data.path counted, the first MAX_LISTED_BAD_LINES named, and what eyas
    does."""
    shown = "\n    ".join(bad[:MAX_LISTED_BAD_LINES])
    more = (
        f"\n    ... and {len(bad) - MAX_LISTED_BAD_LINES} more"
        if len(bad) > MAX_LISTED_BAD_LINES
        else ""
    )
    what = (
        "data.bad_lines: error stops at the first; fix them, or set data.bad_lines: skip to "
        "drop them"
        if cfg.data.bad_lines == "error"
        else "data.bad_lines: skip drops them, counted in report.json's data"
    )
    return f"data.path={cfg.data.path}: {len(bad)} bad line(s) ({what}):\n    {shown}{more}"
