"""Caption tokenisation shared by every stage (and by vltrain)."""

import re
from functools import lru_cache
from importlib import resources

_TOKEN = re.compile(r"\w+|[^\w\s]")
_WORD = re.compile(r"\w+")


def tokenize(caption: str) -> list[str]:
    """Lowercased tokens; each punctuation mark is a token of its own (Fistful of Words, Fig. 2)."""
    return _TOKEN.findall(caption.lower())


def words(caption: str) -> list[str]:
    """Lowercased word tokens only (no punctuation), used for lengths and vocabularies."""
    return _WORD.findall(caption.lower())


@lru_cache(maxsize=None)
def stop_words() -> frozenset[str]:
    """NLTK's English stop-word list (179 words), shipped as package data since nltk.download fails offline."""
    import nltk.data
    from nltk.corpus.reader import WordListCorpusReader

    root = str(resources.files("vlprep") / "data" / "stopwords")
    if root not in nltk.data.path:
        nltk.data.path.append(root)  # nltk only reads corpora under its data path
    return frozenset(WordListCorpusReader(root, ["english"]).words("english"))
