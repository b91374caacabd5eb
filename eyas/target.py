"""The one reader of a target folder's small parts on this machine: its config and its tokenizer.

    cfg = read_config(checkpoint)                 # config.json, the text config when nested
    hidden, vocab = target_dims(tokenizer_dir, checkpoint)
    tok = load_tokenizer(checkpoint)              # with its chat template

Multimodal wrappers (Kimi-K2.5's KimiK25ForConditionalGeneration) nest the language model's
config under `text_config`; every eyas stage wants that one, so it is flattened here, once.
"""

from __future__ import annotations

import json
from pathlib import Path


def read_config(folder: str | Path) -> dict:
    """The target's config.json; the nested `text_config` when the top level has no hidden_size."""
    path = Path(folder) / "config.json"
    if not path.exists():
        raise ValueError(f"{path}: target config.json not found")
    cfg = json.loads(path.read_text())
    return cfg.get("text_config", cfg) if "hidden_size" not in cfg else cfg


def target_dims(*folders: str | Path | None) -> tuple[int, int]:
    """(hidden_size, vocab_size) from the first folder that has a config.json."""
    tried = []
    for folder in folders:
        if folder is None:
            continue
        path = Path(folder) / "config.json"
        tried.append(str(path))
        if path.exists():
            cfg = read_config(folder)
            try:
                return int(cfg["hidden_size"]), int(cfg["vocab_size"])
            except KeyError as e:
                raise ValueError(f"{path}: no {e.args[0]} in the target config") from None
    raise ValueError(f"no target config.json found (tried {tried}); the vocabulary check and the "
                     f"disk estimate need hidden_size and vocab_size")


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
