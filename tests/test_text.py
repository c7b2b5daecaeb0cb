"""vlprep.text: the tokeniser every stage (and vltrain) shares, word tokens, NLTK's stop words."""

from pathlib import Path

from vlprep.text import stop_words, tokenize, words

STOP = set((Path(__file__).parents[1] / "vlprep/data/stopwords/english").read_text().split())


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
