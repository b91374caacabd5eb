"""Fixtures the local package's tests share: a small real tokenizer of the tiny target's kind."""

import pytest

from eyas.local import tiny_corpus as tc


@pytest.fixture(scope="module")
def small_tokenizer():
    """A real BPE tokenizer, trained on a few standard-library files so that it is quick."""
    return tc.train_tokenizer(tc.stdlib_files()[:40], vocab_size=600)
