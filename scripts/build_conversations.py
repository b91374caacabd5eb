"""Build fixtures/data/conversations.jsonl: the tiny target's chat data, from code it never saw.

    python scripts/build_conversations.py            # after fixtures/tiny-target exists

Source: the Python source of pip 26.3 as installed in this project's venv (pip/_internal/**/*.py and
the vendored packages listed in VENDORED below). The tiny target trained on the standard library
alone, and pip lives in site-packages, which that corpus leaves out. Vendored packages with a twin
in the standard library (tomli, which became tomllib) or made mostly of data tables (idna, pygments)
are left out, and a conversation whose answer appears word for word in the standard library is
dropped, so the answers are code the target has not seen.

Each conversation is "Continue this code:\n" plus 6-18 lines of a file, answered by the next 4-12
lines; about a third go on with "Continue." and 4-10 more lines. Candidates are cut with a seeded
random.Random from the files in sorted order, kept when they render to 120-400 tokens with the
fixture's tokenizer and chat template, shuffled, and the first COUNT are written. A different pip
gives different data, so the script refuses to run on any other version.
"""

from __future__ import annotations

import json
import os
import random
import sys
from pathlib import Path

import pip
from transformers import AutoTokenizer

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from eyas.local import tiny_corpus as tc  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
OUT = REPO / "fixtures" / "data" / "conversations.jsonl"
TOKENIZER = REPO / "fixtures" / "tiny-target"
PIP_VERSION = "26.3"
VENDORED = (
    "cachecontrol",
    "distlib",
    "distro",
    "msgpack",
    "packaging",
    "platformdirs",
    "pyproject_hooks",
    "requests",
    "resolvelib",
    "rich",
    "truststore",
    "urllib3",
)
COUNT, SEED = 500, 0
MIN_TOKENS, MAX_TOKENS = 120, 400  # the pipeline truncates at 384; a few go past it on purpose
MAX_LINE = 120  # longer lines are data tables, not code


def source_files(pip_root: Path) -> list[Path]:
    """pip's own code and the kept vendored packages, sorted by path inside pip."""
    parts = [pip_root / "_internal"] + [pip_root / "_vendor" / name for name in VENDORED]
    files = [f for part in parts for f in part.rglob("*.py")]
    return sorted(files, key=lambda f: f.relative_to(pip_root).as_posix())


def candidates(files: list[Path], rng: random.Random) -> list[list[dict]]:
    """About one conversation per 120 lines of each file, a third of them two-turn."""
    found = []
    for file in files:
        lines = tc.read_text(file).splitlines(keepends=True)
        for _ in range(max(1, len(lines) // 120)):
            messages = tc.code_conversation(lines, rng, multi_turn=rng.random() < 0.33)
            if messages and all(
                len(line) <= MAX_LINE for m in messages for line in m["content"].splitlines()
            ):
                found.append(messages)
    return found


def main() -> None:
    if pip.__version__ != PIP_VERSION:
        raise SystemExit(
            f"this fixture is built from pip {PIP_VERSION}, but pip {pip.__version__} is installed"
        )
    rng = random.Random(SEED)
    tokenizer = AutoTokenizer.from_pretrained(TOKENIZER)
    stdlib_text = "\n".join(tc.read_text(f) for f in tc.stdlib_files())
    pool = candidates(source_files(Path(pip.__file__).parent), rng)
    rng.shuffle(pool)

    kept, seen = [], set()
    for messages in pool:
        key = json.dumps(messages)
        answers = [m["content"] for m in messages if m["role"] == "assistant"]
        if key in seen or any(a.strip() in stdlib_text for a in answers):
            continue
        if MIN_TOKENS <= len(tc.chat_token_ids(tokenizer, messages)) <= MAX_TOKENS:
            kept.append(key)
            seen.add(key)
        if len(kept) == COUNT:
            break
    if len(kept) < COUNT:
        raise SystemExit(
            f"only {len(kept)} of {COUNT} conversations fit {MIN_TOKENS}-{MAX_TOKENS} tokens"
        )

    OUT.parent.mkdir(parents=True, exist_ok=True)
    tmp = OUT.with_name(f".{OUT.name}.tmp-{os.getpid()}")
    tmp.write_text("".join(f'{{"messages": {key}}}\n' for key in kept))
    os.replace(tmp, OUT)  # readers see the old file or the new one
    num_multi_turn = sum(key.count('"role": "user"') == 2 for key in kept)
    print(
        f"wrote {len(kept)} conversations ({num_multi_turn} two-turn) from {len(pool)} "
        f"candidates to {OUT}"
    )


if __name__ == "__main__":
    main()
