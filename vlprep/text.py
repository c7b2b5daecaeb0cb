"""Caption tokenisation shared by every stage (and by vltrain)."""

import re
from functools import lru_cache
from importlib import resources

_TOKEN = re.compile(r"\w+|[^\w\s]")
_WORD = re.compile(r"\w+")


# The definitions are the two regexes above. tokenize and words take a shortcut that gives the same lists
# for every code point: str.split() splits on exactly the characters `\s` matches, and a piece with no space in it
# is one `\w+` run when str.isalnum() holds (`\w` is isalnum() or "_"). Only the pieces that fail the test go
# through the regex, which alone was most of `vlprep bow`'s per-caption cost.


def tokenize(caption: str) -> list[str]:
    """Lowercased tokens; each punctuation mark is a token of its own (Fistful of Words, Fig. 2)."""
    s = caption.lower()
    pieces = s.split()
    if s.replace(" ", "").isalnum():  # only words and plain spaces: the common caption
        return pieces
    out = []
    for p in pieces:
        if p.isalnum():
            out.append(p)
        else:
            out += _TOKEN.findall(p)
    return out


def words(caption: str) -> list[str]:
    """Lowercased word tokens only (no punctuation), used for lengths and vocabularies."""
    s = caption.lower()
    if s.replace(" ", "").isalnum():
        return s.split()
    return _WORD.findall(s)


@lru_cache(maxsize=None)
def stop_words() -> frozenset[str]:
    """NLTK's English stop-word list (179 words), shipped as package data since nltk.download fails offline."""
    import nltk.data
    from nltk.corpus.reader import WordListCorpusReader

    root = str(resources.files("vlprep") / "data" / "stopwords")
    if root not in nltk.data.path:
        nltk.data.path.append(root)  # nltk only reads corpora under its data path
    return frozenset(WordListCorpusReader(root, ["english"]).words("english"))
