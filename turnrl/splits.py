"""The train/test split of a generated task's questions, fixed by a hash of a key (a question's
text, a town's name), so that a key lands in the same split on every run and every machine."""

import hashlib
from typing import Literal

Split = Literal["train", "test"]
# One key in TEST_SHARE_BUCKETS of BUCKETS belongs to the test split.
BUCKETS = 10
TEST_SHARE_BUCKETS = 1


def split_of(key: str) -> Split:
    """The split of the questions about `key`."""
    bucket = hashlib.blake2b(key.encode(), digest_size=8).digest()[0] % BUCKETS
    return "test" if bucket < TEST_SHARE_BUCKETS else "train"


def check_split(split: str) -> None:
    """Raises ValueError for a split other than train and test."""
    if split not in ("train", "test"):
        raise ValueError(f"unknown split {split!r}; expected 'train' or 'test'")
