"""Unified diffs, applied strictly by content: no fuzz, no offsets, no `patch` binary on the host.

    text = apply_diff(original, diff, name="deepseek_v2.py")        # DiffError if a hunk differs
    original = apply_diff(text, diff, reverse=True)

The patch stage (eyas/server/sglang_patch.py) checks the sha256 before and after every
application, so an exact match is all it needs.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from eyas.errors import EyasError


class DiffError(EyasError, ValueError):
    """A diff that cannot be read, or a hunk that does not match the text exactly."""


_HUNK_RE = re.compile(r"^@@ -(\d+)(?:,(\d+))? \+(\d+)(?:,(\d+))? @@")


@dataclass
class Hunk:
    old_start: int  # 1-based, as in the header
    old_count: int
    new_start: int
    new_count: int
    old_lines: list[str]  # with their line endings
    new_lines: list[str]


# A line-by-line reader of the unified diff format, one branch per kind of line.
def parse_diff(diff: str) -> tuple[str, list[Hunk]]:  # noqa: C901
    """The target path (from `+++ b/<path>`) and hunks of a one-file unified diff."""
    path, hunks = None, []
    hunk, left_old, left_new, last_kind = None, 0, 0, None
    for line in diff.splitlines(keepends=True):
        if line.startswith("\\") and hunk is not None:  # "\ No newline at end of file"
            if last_kind in (" ", "-"):
                hunk.old_lines[-1] = hunk.old_lines[-1].rstrip("\n")
            if last_kind in (" ", "+"):
                hunk.new_lines[-1] = hunk.new_lines[-1].rstrip("\n")
            continue
        if hunk is not None and (left_old > 0 or left_new > 0):
            kind, body = (" ", line) if line in ("\n", "\r\n") else (line[:1], line[1:])
            if kind not in (" ", "-", "+"):
                raise DiffError(f"hunk at line {hunk.old_start} ends early: {line.rstrip()!r}")
            if kind in (" ", "-"):
                hunk.old_lines.append(body)
                left_old -= 1
            if kind in (" ", "+"):
                hunk.new_lines.append(body)
                left_new -= 1
            last_kind = kind
            continue
        hunk = None
        if line.startswith("+++ "):
            if path is not None:
                raise DiffError("the diff patches more than one file")
            path = line[4:].rstrip("\r\n").split("\t")[0]
            path = path[2:] if path.startswith("b/") else path
        elif line.startswith("@@"):
            m = _HUNK_RE.match(line)
            if not m:
                raise DiffError(f"bad hunk header {line.strip()!r}")
            a, b, c, d = (int(g) if g is not None else 1 for g in m.groups())
            hunk, left_old, left_new = Hunk(a, b, c, d, [], []), b, d
            hunks.append(hunk)
    if path is None or not hunks:
        raise DiffError("not a unified diff (no +++ header or no hunks)")
    if left_old > 0 or left_new > 0:
        raise DiffError(
            f"the last hunk is cut short ({left_old} old / {left_new} new lines missing)"
        )
    return path, hunks


def apply_diff(text: str, diff: str, *, reverse: bool = False, name: str = "<file>") -> str:
    """text with diff applied (or un-applied); DiffError if any hunk does not match exactly."""
    try:
        _, hunks = parse_diff(diff)
    except ValueError as e:
        raise DiffError(f"{name}: cannot read the patch: {e}") from e
    lines = text.splitlines(keepends=True)
    out, pos = [], 0
    for h in hunks:
        start, count, old, new = (
            (h.new_start, h.new_count, h.new_lines, h.old_lines)
            if reverse
            else (h.old_start, h.old_count, h.old_lines, h.new_lines)
        )
        index = start if count == 0 else start - 1  # an empty side names the line before it
        if index < pos or lines[index : index + len(old)] != old:
            raise DiffError(
                f"{name}: hunk at line {start} does not match "
                f"({'reverse' if reverse else 'forward'} application)"
            )
        out += lines[pos:index] + new
        pos = index + len(old)
    return "".join(out + lines[pos:])
