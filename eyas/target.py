"""Reading the target checkpoint's small parts on this machine: tokenizer and config."""

from __future__ import annotations

import json
from pathlib import Path


def load_tokenizer(path: str | Path):
    """The target's tokenizer with its chat template (Hugging Face layout)."""
    from transformers import AutoTokenizer

    path = Path(path)
    if not (path / "tokenizer.json").exists() and not (path / "tokenizer_config.json").exists():
        raise ValueError(f"{path}: no tokenizer files (tokenizer.json / tokenizer_config.json) here")
    tok = AutoTokenizer.from_pretrained(str(path))
    if not tok.chat_template:
        raise ValueError(f"{path}: the tokenizer has no chat_template; the loss mask needs one")
    return tok


def load_target_config(path: str | Path) -> dict:
    path = Path(path) / "config.json"
    if not path.exists():
        raise ValueError(f"{path}: target config.json not found")
    return json.loads(path.read_text())
