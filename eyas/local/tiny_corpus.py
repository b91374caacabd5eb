"""The tiny target's corpus, tokenizer and chat template: everything its build prepares before
training.

    # stdlib *.py -> tokenizer.json, tokens.npz
    info = prepare_inputs(workdir)
    # a conversation, as the target reads it
    ids = chat_token_ids(hf_tokenizer(tokenizer), messages)

The corpus is the Python standard library's own source, split by file (a hash of the path picks
train / val / test), plus rendered "continue this code" conversations that teach the chat template.
scripts/build_conversations.py cuts the pipeline's chat data with the same code_conversation. The
model and its training are in eyas/local/tiny_target.py.
"""

from __future__ import annotations

import hashlib
import json
import platform
import random
import sysconfig
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from eyas.errors import InvalidInput
from eyas.files import atomic_dir

# --------------------------------------------------------------------------------------------------
# Tokens and chat template
# --------------------------------------------------------------------------------------------------

#: The BPE trainer gives special tokens the first ids, in this order; BOS_ID..PAD_ID rely on it.
SPECIAL_TOKENS = (
    "<|bos|>",
    "<|eos|>",
    "<|pad|>",
    "<|user|>",
    "<|assistant|>",
    "<|system|>",
    "<|end|>",
)
BOS, EOS, PAD, END = "<|bos|>", "<|eos|>", "<|pad|>", "<|end|>"
BOS_ID, EOS_ID, PAD_ID, END_ID = 0, 1, 2, 6
#: Generation stops at the end of a turn (<|end|>) or of a document (<|eos|>).
STOP_TOKEN_IDS = (END_ID, EOS_ID)
MIN_VOCAB = 256 + len(SPECIAL_TOKENS)  # every byte, plus the special tokens

#: Each turn is <|role|>content<|end|>, with no text between turns. Every turn boundary is a special
#: token, and special tokens split the text before BPE runs, so rendering a prefix of the messages
#: (with or without the generation prompt) gives a token prefix of the full rendering, and an
#: assistant's content is the contiguous span between its <|assistant|> and <|end|>. (Content that
#: spells a special token, e.g. "<|end|>", would be read as that token; code and prose here never
#: do.)
CHAT_TEMPLATE = (
    "{{- bos_token -}}{%- for message in messages -%}"
    "{%- if message['role'] not in ('system', 'user', 'assistant') -%}"
    "{{- raise_exception('unknown chat role: ' ~ message['role']) -}}{%- endif -%}"
    "{{- '<|' ~ message['role'] ~ '|>' ~ message['content'] ~ '<|end|>' -}}{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|assistant|>' -}}{%- endif -%}"
)
#: The task the chat data teaches; scripts/build_conversations.py makes the fixture data the same
#: way.
CONTINUE_PROMPT = "Continue this code:\n"
NEXT_PROMPT = "Continue."


def train_tokenizer(files: list[Path], vocab_size: int) -> Tokenizer:
    """A byte-level BPE tokenizer trained on `files`, with SPECIAL_TOKENS as ids 0..6."""
    if vocab_size < MIN_VOCAB or vocab_size > 65535:  # token arrays are stored as uint16
        raise InvalidInput(f"vocab_size must be in [{MIN_VOCAB}, 65535], got {vocab_size}")
    if not files:
        raise InvalidInput("train_tokenizer needs at least one file")
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # every byte, so nothing is unknown
        show_progress=False,
    )
    tokenizer.train_from_iterator((read_text(f) for f in files), trainer=trainer)
    return tokenizer


def hf_tokenizer(tokenizer: Tokenizer) -> PreTrainedTokenizerFast:
    """The transformers view of `tokenizer`, with the chat template and special tokens set."""
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        chat_template=CHAT_TEMPLATE,
    )


def chat_token_ids(
    hf: PreTrainedTokenizerFast, messages: list[dict], add_generation_prompt: bool = False
) -> list[int]:
    """Token ids of `messages` rendered with CHAT_TEMPLATE (the rendering starts with <|bos|>)."""
    text = hf.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=add_generation_prompt
    )
    return hf.backend_tokenizer.encode(text, add_special_tokens=False).ids


def code_conversation(
    lines: list[str], rng: random.Random, *, multi_turn: bool
) -> list[dict] | None:
    """A "continue this code" conversation cut from a random window of `lines` (kept with their
    newlines); None when the file is too short or a part of the window is blank."""
    num_prompt, num_answer = rng.randint(6, 18), rng.randint(4, 12)
    num_second = rng.randint(4, 10) if multi_turn else 0
    need = num_prompt + num_answer + num_second
    if len(lines) < need:
        return None
    start = rng.randrange(len(lines) - need + 1)
    cuts = [start, start + num_prompt, start + num_prompt + num_answer, start + need]
    parts = ["".join(lines[a:b]) for a, b in zip(cuts, cuts[1:]) if b > a]
    if any(not part.strip() for part in parts):
        return None
    messages = [
        {"role": "user", "content": CONTINUE_PROMPT + parts[0]},
        {"role": "assistant", "content": parts[1]},
    ]
    if multi_turn:
        messages += [
            {"role": "user", "content": NEXT_PROMPT},
            {"role": "assistant", "content": parts[2]},
        ]
    return messages


# --------------------------------------------------------------------------------------------------
# Corpus: the standard library's own source, split by file
# --------------------------------------------------------------------------------------------------

EXCLUDED_DIRS = frozenset({"test", "tests", "idlelib", "site-packages"})


def read_text(path: Path) -> str:
    return path.read_text(encoding="utf-8", errors="replace")


def stdlib_files(root: Path | None = None) -> list[Path]:
    """The *.py files of the standard library under `root`, sorted by relative path, tests
    excluded."""
    root = Path(sysconfig.get_paths()["stdlib"]) if root is None else Path(root)
    files = [
        p
        for p in root.rglob("*.py")
        if not EXCLUDED_DIRS.intersection(p.relative_to(root).parts[:-1])
    ]
    if not files:
        raise InvalidInput(f"no *.py files under {root} (is it the standard library?)")
    return sorted(files, key=lambda p: p.relative_to(root).as_posix())


def split_of(relative_path: str) -> str:
    """ "test" (2%), "val" (2%) or "train", from a hash of the path: stable when files come and
    go."""
    bucket = int(hashlib.sha256(relative_path.encode()).hexdigest(), 16) % 100
    return "test" if bucket < 2 else "val" if bucket < 4 else "train"


def encode_documents(tokenizer: Tokenizer, texts: list[str]) -> np.ndarray:
    """One token stream, each text framed as <|bos|> text <|eos|> (chat renderings bring their own
    bos)."""
    framed = [t + EOS if t.startswith(BOS) else BOS + t + EOS for t in texts]
    ids = [
        np.asarray(e.ids, dtype=np.uint16)
        for e in tokenizer.encode_batch(framed, add_special_tokens=False)
    ]
    return np.concatenate(ids) if ids else np.zeros(0, dtype=np.uint16)


def chat_documents(hf: PreTrainedTokenizerFast, texts: list[str], rng: random.Random) -> list[str]:
    """Rendered "continue this code" conversations, about one per 150 lines, a quarter of them
    two-turn. They teach the model the chat template, so that it answers the pipeline's prompts in
    kind."""
    rendered = []
    for text in texts:
        lines = text.splitlines(keepends=True)
        for _ in range(max(1, len(lines) // 150)):
            messages = code_conversation(lines, rng, multi_turn=rng.random() < 0.25)
            if messages is not None:
                rendered.append(hf.apply_chat_template(messages, tokenize=False))
    return rendered


def prepare_inputs(
    workdir: Path, *, vocab_size: int = 4096, seed: int = 0, root: Path | None = None
) -> dict:
    """Gather and split the corpus, train the tokenizer and write the token streams into
    `workdir`."""
    root = Path(sysconfig.get_paths()["stdlib"]) if root is None else Path(root)
    files = stdlib_files(root)
    names = [f.relative_to(root).as_posix() for f in files]
    texts = {name: read_text(f) for name, f in zip(names, files)}
    split = {name: split_of(name) for name in names}
    train_names = [n for n in names if split[n] == "train"]

    tokenizer = train_tokenizer([root / n for n in train_names], vocab_size)
    rng = random.Random(seed)
    chats = chat_documents(hf_tokenizer(tokenizer), [texts[n] for n in train_names], rng)
    train_docs = [texts[n] for n in train_names] + chats
    rng.shuffle(train_docs)  # interleave chat and raw documents
    streams = {"train": encode_documents(tokenizer, train_docs)}
    for part in ("val", "test"):
        streams[part] = encode_documents(tokenizer, [texts[n] for n in names if split[n] == part])

    with atomic_dir(Path(workdir)) as tmp:
        tokenizer.save(str(tmp / "tokenizer.json"))
        np.savez(tmp / "tokens.npz", **streams)
        info = {
            "python": platform.python_version(),
            "stdlib": str(root),
            "corpus_sha256": hashlib.sha256("".join(texts[n] for n in names).encode()).hexdigest(),
            "vocab_size": tokenizer.get_vocab_size(),
            "num_files": {p: sum(s == p for s in split.values()) for p in ("train", "val", "test")},
            "num_chat_conversations": len(chats),
            "num_tokens": {p: int(a.size) for p, a in streams.items()},
            "test_files": [n for n in names if split[n] == "test"],
            "val_files": [n for n in names if split[n] == "val"],
        }
        (tmp / "inputs.json").write_text(json.dumps(info, indent=2) + "\n")
    return info
