"""Layer ids: the conventions and SGLang's reading of them.

A layer id names one hidden state of the target's residual stream. eyas's own form is
capture-before: id i is the stream entering decoder layer i (HF hidden_states[i], SGLang's capture
index). A config or a record may give ids output-of instead: id i is the output of decoder layer i,
which is the stream entering layer i + 1, so output-of i is capture-before i + 1.

    to_capture_before([1, 29, 57], "output-of")     # [2, 30, 58]
    to_output_of([2, 30, 58])                       # [1, 29, 57]

SGLang reads ids in neither convention alone. A model class's set_eagle3_layers_to_capture turns
the ids it is given (--return-aux-hidden-state-layer-ids, or an EAGLE-3 draft's eagle_config) into
the capture-before layers it captures by a rule of its own: DeepSeek-V2's family takes a list
starting with 1 as output-of ids and shifts it by +1, and any other list as capture-before ids;
Llama's family shifts every id by +1.

    captured_layer_ids([1, 3, 4], "LlamaForCausalLM")    # [2, 4, 5]: what it captures
    server_layer_ids([2, 4, 5], "LlamaForCausalLM")      # [1, 3, 4]: what to ask for
    eagle_config_capture_ids([1, 3, 4])                  # [2, 4, 5]

That rule's one home is eyas/dump.py: the SGLang hook runs it on the GPU host, where dump.py is
installed alone (as eyas_dump.py) and eyas is not. This module reads the rule from there, and
imports dump.py only inside the functions that apply it, because dump.py loads torch and the
config section, which needs none, converts its ids here.
"""

from __future__ import annotations

from typing import Iterable, Literal, get_args

from eyas.errors import InvalidInput

Convention = Literal["capture-before", "output-of"]
#: the conventions a config, a dump record or a shard may name its layer ids in (dump.py keeps the
#: same tuple as LAYER_CONVENTIONS, for its writer's check inside SGLang)
CONVENTIONS: tuple[str, ...] = get_args(Convention)


def to_capture_before(ids: Iterable[int], convention: str) -> list[int]:
    """`ids` given in `convention`, as capture-before ids (what a server captures).

    An unknown convention is refused rather than read as capture-before: ids read one layer off
    feed the drafter the wrong hidden states, and nothing downstream notices.
    """
    if convention not in CONVENTIONS:
        raise InvalidInput(
            f"unknown layer_convention {convention!r}: expected one of {list(CONVENTIONS)}"
        )
    shift = 1 if convention == "output-of" else 0
    return [i + shift for i in ids]


def to_output_of(capture_ids: Iterable[int]) -> list[int]:
    """Capture-before ids as output-of ids (the provenance shards record beside them).

    Capture-before 0, the embeddings' output, is no layer's output: it comes out as -1.
    """
    return [i - 1 for i in capture_ids]


def captured_layer_ids(server_ids: list[int], architecture: str | None = None) -> list[int]:
    """The capture-before layers SGLang's `architecture` captures when asked for `server_ids`:
    +1 for the classes in dump.PLUS_ONE_ARCHITECTURES, DeepSeek-V2's rule for any other (or
    None)."""
    from eyas import dump  # here, not above: it loads torch

    return dump.captured_layer_ids(server_ids, architecture)


def server_layer_ids(capture_ids: list[int], architecture: str | None = None) -> list[int]:
    """The ids to ask SGLang's `architecture` for so that it captures the capture-before layers
    `capture_ids` (the inverse of captured_layer_ids); ValueError when its rule cannot give them
    (a Llama asked for capture-before 0, DeepSeek-V2 asked for a list starting with 1)."""
    from eyas import dump  # here, not above: it loads torch

    return dump.server_layer_ids(capture_ids, architecture)


def eagle_config_capture_ids(ids: list[int]) -> list[int]:
    """The capture-before layers SGLang captures for an exported drafter's
    eagle_aux_hidden_state_layer_ids.

    The list reaches the same set_eagle3_layers_to_capture as the server flag. eyas exports
    capture-before ids and reads them back by DeepSeek-V2's rule (the local server follows it too),
    so a list starting with 1 comes back shifted by +1: export and preflight refuse such ids.
    """
    return captured_layer_ids(ids)
