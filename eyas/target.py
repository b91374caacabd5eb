"""The one reader of a target folder's small parts on this machine: its config and its tokenizer.

    folder = local_copy(cfg.target)               # target.local_dir, else target.checkpoint
    tcfg = read_config(folder)                    # config.json, the text config when nested
    hidden, vocab = target_dims(folder)
    # with its chat template, trust_remote_code as configured
    tok = target_tokenizer(cfg)

The orchestrator (prepare-data, preflight, the held-out prompts, the export's checks, the evaluation
suites) reads the target from its local copy (`target.local_dir`: config.json, tokenizer files and
chat template, no weights), never from the server host's checkpoint; a local server host's
checkpoint is that copy by default.

Multimodal wrappers (Kimi-K2.5's KimiK25ForConditionalGeneration) nest the language model's
config under `text_config`; every eyas stage wants that one, so it is flattened here, once.

Some targets ship their tokenizer as Python code named by tokenizer_config.json's `auto_map`
(Kimi-K2.5's TikTokenTokenizer); transformers runs it only with trust_remote_code, which
`target.trust_remote_code` sets (None = on for server.backend sglang, whose launch trusts it too).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

from eyas.errors import EyasError, InvalidInput

if TYPE_CHECKING:  # the training path reads a target without pydantic (a GPU host's bare python)
    from eyas.config import TargetConfig


def read_config(folder: str | Path) -> dict:
    """The target's config.json; the nested `text_config` when the top level has no hidden_size."""
    path = Path(folder) / "config.json"
    if not path.exists():
        raise InvalidInput(f"{path}: target config.json not found")
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
                raise InvalidInput(f"{path}: no {e.args[0]} in the target config") from None
    raise InvalidInput(
        f"no target config.json found (tried {tried}); the vocabulary check and the "
        f"disk estimate need hidden_size and vocab_size"
    )


class RemoteCodeRefused(EyasError, ValueError):
    """The tokenizer is code the folder ships (auto_map) and trust_remote_code is off."""


def local_copy(target) -> Path:
    """This machine's copy of the target's small files: target.local_dir, else target.checkpoint."""
    return Path(target.local_dir if target.local_dir is not None else target.checkpoint)


def trust_remote_code(target: TargetConfig, backend: str) -> bool:
    """target.trust_remote_code; None = on for server.backend sglang (SGLang loads the same
    code)."""
    setting = target.trust_remote_code
    return backend == "sglang" if setting is None else setting


def target_tokenizer(cfg):
    """The target's tokenizer from its local copy, loaded as every eyas stage loads it."""
    return load_tokenizer(
        local_copy(cfg.target), trust_remote_code=trust_remote_code(cfg.target, cfg.server.backend)
    )


def remote_tokenizer_class(path: str | Path) -> str | None:
    """The class tokenizer_config.json's auto_map names for AutoTokenizer (remote code), or None."""
    try:
        auto = json.loads((Path(path) / "tokenizer_config.json").read_text()).get("auto_map") or {}
    except (OSError, ValueError, AttributeError):
        return None
    named = auto.get("AutoTokenizer") if isinstance(auto, dict) else None
    if isinstance(named, (list, tuple)):
        named = next((n for n in named if n), None)
    return named if isinstance(named, str) else None


def load_tokenizer(path: str | Path, *, trust_remote_code: bool = False):
    """The target's tokenizer with its chat template (Hugging Face layout). trust_remote_code runs
    the tokenizer code the folder ships, if any; without it such a folder raises
    RemoteCodeRefused."""
    from transformers import AutoTokenizer

    path = Path(path)
    if not (path / "tokenizer.json").exists() and not (path / "tokenizer_config.json").exists():
        raise InvalidInput(
            f"{path}: no tokenizer files (tokenizer.json / tokenizer_config.json) here"
        )
    try:
        # Always an explicit bool: None would make transformers ask on the terminal.
        tok = AutoTokenizer.from_pretrained(str(path), trust_remote_code=bool(trust_remote_code))
    except ValueError as e:
        remote = remote_tokenizer_class(path)
        if trust_remote_code or remote is None:
            raise
        raise RemoteCodeRefused(
            f"{path}: the tokenizer is code the folder ships ({remote}, named by "
            f"tokenizer_config.json's "
            f"auto_map), which eyas runs only with target.trust_remote_code: true (it is off: set "
            f"it, or leave it unset with server.backend sglang)"
        ) from e
    if not tok.chat_template:
        raise InvalidInput(f"{path}: the tokenizer has no chat_template; the loss mask needs one")
    # transformers' "sequence length is longer than the specified maximum" names no line: eyas's
    # data checks report an over-long record with its file:line and the fix
    # (eyas/extraction/data.py).
    getattr(tok, "deprecation_warnings", {})[
        "sequence-length-is-longer-than-the-specified-maximum"
    ] = True
    return tok
