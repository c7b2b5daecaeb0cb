"""vlprep.text: the tokeniser every stage (and vltrain) shares, word tokens, NLTK's stop words."""

from pathlib import Path

import pytest

from vlprep.text import stop_words, tokenize, words

STOP = set((Path(__file__).parents[2] / "vlprep/data/stopwords/english").read_text().split())


def test_tokenize_lowercases_and_splits_every_punctuation_mark():
    assert tokenize("A Dog's toy, (red)!") == ["a", "dog", "'", "s", "toy", ",", "(", "red", ")", "!"]
    assert tokenize("Café  au-lait 2x") == ["café", "au", "-", "lait", "2x"]
    assert tokenize("") == [] and tokenize("   ") == []


def test_words_drop_punctuation_only():
    assert words("A Dog's toy, (red)!") == ["a", "dog", "s", "toy", "red"]
    assert words("x_y 3.5") == ["x_y", "3", "5"]  # \w keeps underscores and digits


def test_stop_words_are_nltks_179():
    assert stop_words() == STOP and len(STOP) == 179 and {"the", "a", "don't", "wouldn"} <= STOP
    assert stop_words() is stop_words()  # read once


@pytest.mark.slow  # about 4.5 s: all 1.1M code points
def test_tokenize_and_words_equal_their_regexes_on_every_code_point():
    import random
    import re
    import sys

    token, word = re.compile(r"\w+|[^\w\s]"), re.compile(r"\w+")
    chars = [chr(i) for i in range(sys.maxunicode + 1) if not 0xD800 <= i <= 0xDFFF]
    rng = random.Random(0)
    cases = ["", " ", "a b", "A Dog's toy, (red)!", "x_y 3.5", "ab\u00a0cd", "İstanbul", "ǅungla ß", "½ ²"]
    for i in range(0, len(chars), 7):  # every code point, inside words, alone, and next to punctuation
        chunk = "".join(chars[i:i + 7])
        cases += [chunk, f"ab{chunk}cd ef", f" {chunk[::-1]}, x.", " ".join(chunk)]
    cases += ["".join(rng.choice(chars[:600]) for _ in range(rng.randint(0, 40))) for _ in range(3000)]
    for c in cases:
        assert tokenize(c) == token.findall(c.lower()), repr(c)
        assert words(c) == word.findall(c.lower()), repr(c)
