"""Caption tokenisation shared by every stage (and by vltrain)."""

import re

_TOKEN = re.compile(r"\w+|[^\w\s]")
_WORD = re.compile(r"\w+")


def tokenize(caption: str) -> list[str]:
    """Lowercased tokens; each punctuation mark is a token of its own (Fistful of Words, Fig. 2)."""
    return _TOKEN.findall(caption.lower())


def words(caption: str) -> list[str]:
    """Lowercased word tokens only (no punctuation), used for lengths and vocabularies."""
    return _WORD.findall(caption.lower())
