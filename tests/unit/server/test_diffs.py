"""Unified diffs read and applied strictly by content (the shipped patch sets:
test_patch_sets.py)."""

from __future__ import annotations

import pytest

from eyas.errors import EyasError
from eyas.server.diffs import DiffError, apply_diff, parse_diff

DIFF = """--- a/pkg/f.py
+++ b/pkg/f.py
@@ -1,3 +1,4 @@
 one
+inserted
 two
 three
@@ -6,2 +7,2 @@
 six
-seven
+SEVEN
"""
OLD = "one\ntwo\nthree\nfour\nfive\nsix\nseven\n"
NEW = "one\ninserted\ntwo\nthree\nfour\nfive\nsix\nSEVEN\n"


def test_parse_diff_gives_the_target_path_and_every_hunk():
    path, hunks = parse_diff(DIFF)
    assert path == "pkg/f.py"
    assert [(h.old_start, h.old_count, h.new_start, h.new_count) for h in hunks] == [
        (1, 3, 1, 4),
        (6, 2, 7, 2),
    ]
    assert hunks[1].old_lines == ["six\n", "seven\n"] and hunks[1].new_lines == ["six\n", "SEVEN\n"]


def test_two_hunks_apply_and_reverse_exactly():
    assert apply_diff(OLD, DIFF) == NEW
    assert apply_diff(NEW, DIFF, reverse=True) == OLD


@pytest.mark.parametrize(
    "diff, message",
    [
        ("just text\n", r"no \+\+\+ header or no hunks"),
        (DIFF.replace("@@ -6,2 +7,2 @@", "@@ bad @@"), "bad hunk header"),
        (DIFF + "--- a/g.py\n+++ b/g.py\n@@ -1 +1 @@\n-x\n+y\n", "more than one file"),
        (DIFF.rsplit("+SEVEN\n", 1)[0], "cut short"),
    ],
)
def test_an_unreadable_diff_is_a_diff_error_naming_the_file(diff, message):
    with pytest.raises(
        DiffError,
        match=rf"^deepseek_v2\.py: cannot read the patch: "
        rf".*{message}",
    ) as e:
        apply_diff(OLD, diff, name="deepseek_v2.py")
    assert isinstance(e.value, EyasError) and isinstance(e.value, ValueError)


def test_a_hunk_that_differs_names_its_line_and_direction():
    with pytest.raises(
        DiffError,
        match=r"f\.py: hunk at line 6 does not match \(forward "
        r"application\)",
    ):
        apply_diff(OLD.replace("seven", "7"), DIFF, name="f.py")
    with pytest.raises(DiffError, match=r"hunk at line 1 does not match \(reverse application\)"):
        apply_diff(OLD, DIFF, reverse=True)
