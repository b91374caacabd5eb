"""The data section: the conversations the drafter is trained on, and their regeneration by the
target."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field

from eyas.config.base import StrictModel


class RegenerateConfig(StrictModel):
    """Answer the training conversations' assistant turns again with the target
    (eyas/extraction/regenerate.py)."""

    enabled: bool = False
    max_new_tokens: int = Field(512, ge=1)  #: per assistant turn
    #: sampling temperature; null = as the target is meant to be asked: 0 (greedy) without thinking,
    #: 1.0 with thinking on (Kimi-K2.5's recommendation for its thinking mode: reasoning decoded
    #: greedily falls into loops, which the drafter would learn). Above 0, a seed per conversation
    #: and turn
    temperature: float | None = Field(None, ge=0)
    #: nucleus sampling, with a temperature above 0 (Kimi-K2.5 recommends 0.95); 1.0 = off
    top_p: float = Field(1.0, gt=0, le=1)
    seed: int = 0
    num_parts: int = Field(8, ge=1)  #: resumable units: a finished part is never asked again
    output_dir: Path | None = None  #: None = <extraction.output_dir>/regenerated
    #: a thinking (reasoning) target as it is served: true/false pass the chat template's switch
    #: (`thinking_kwarg`) on/off and keep every reply's token ids exactly as the server emitted
    #: them, <think> span included; null = not a thinking model (template default, replies kept as
    #: text)
    thinking: bool | None = None
    #: the chat template's name for that switch: Kimi-K2.5 and DeepSeek-V3.1 `thinking`, Qwen3
    #: `enable_thinking`
    thinking_kwarg: str = Field("thinking", pattern=r"^[A-Za-z_][A-Za-z0-9_]*$")

    def sampling(self) -> dict[str, float]:
        """The sampling parameters each request sends: the temperature, and top_p where it is on."""
        temperature = (
            self.temperature if self.temperature is not None else 1.0 if self.thinking else 0.0
        )
        return {
            "temperature": temperature,
            **({"top_p": self.top_p} if self.top_p < 1 and temperature > 0 else {}),
        }


class DataConfig(StrictModel):
    """The conversations the drafter is trained on."""

    path: Path  #: JSONL, one {"messages": [{"role", "content"}, ...]} per line
    max_length: int = Field(512, gt=1)  #: tokens per sequence
    overlong: Literal["truncate", "drop"] = "truncate"
    num_heldout: int = Field(8, ge=0)  #: last N conversations: evaluation prompts, never trained on
    #: a bad input line (malformed, empty assistant turn, ids outside the vocabulary): "error" stops
    #: with file:line; "skip" drops it, counts it and names it in the data stats
    bad_lines: Literal["error", "skip"] = "error"
    regenerate: RegenerateConfig = RegenerateConfig()
