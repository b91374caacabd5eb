"""The target section: the model whose hidden states train the drafter."""

from __future__ import annotations

from pathlib import Path

from pydantic import Field, model_validator

from eyas.config.base import StrictModel
from eyas.layers import Convention, to_capture_before


class TargetConfig(StrictModel):
    """The target model whose hidden states train the drafter."""

    checkpoint: Path  #: Hugging Face folder (config.json, *.safetensors, index) on the server host
    #: this machine's copy of the target's small files (config.json, tokenizer files and any
    #: tokenizer code, chat template; no weights): all the orchestrator reads of the target
    #: (preflight, data preparation, held-out prompts, export, suites). None = target.checkpoint,
    #: read on this machine (a local server host; with an ssh host only where that path is here
    #: too)
    local_dir: Path | None = None
    #: run the tokenizer code the target folder ships (tokenizer_config.json auto_map, e.g.
    #: Kimi-K2.5's TikTokenTokenizer) when loading it; None = on for server.backend sglang, whose
    #: launch trusts it too
    trust_remote_code: bool | None = None
    revision: str | None = None  #: recorded in manifests; e.g. a hub commit or a local tag
    layer_ids: list[int] = Field(min_length=1)  #: the aux layers, in `layer_convention`
    #: "capture-before": id i is the input of decoder layer i (SGLang's capture index, HF
    #: hidden_states[i]); "output-of": id i is the output of layer i (= capture-before i + 1).
    layer_convention: Convention = "capture-before"

    @model_validator(mode="after")
    def _check_ids(self) -> "TargetConfig":
        ids = self.layer_ids
        if any(i < 0 for i in ids) or len(set(ids)) != len(ids) or ids != sorted(ids):
            raise ValueError(f"layer_ids must be distinct, non-negative and ascending, got {ids}")
        return self

    def capture_ids(self) -> list[int]:
        """Layer ids in the capture-before convention (what the server actually captures)."""
        return to_capture_before(self.layer_ids, self.layer_convention)
