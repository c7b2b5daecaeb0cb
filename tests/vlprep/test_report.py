import json
from collections import Counter

from PIL import Image

from tests.conftest import image_bytes
from vlprep.stats import dataset_stats, distribution
from vlprep.shards import ShardsConfig, build_shards


def test_stats_on_a_known_dataset(tmp_path):
    root = tmp_path / "src"
    root.mkdir()
    captions = ["A red cat.", "the red dog", "a cat, a dog and a bird", "cat"]
    sizes = [(40, 20), (30, 30), (64, 48), (10, 50)]
    for i, (cap, (w, h)) in enumerate(zip(captions, sizes)):
        (root / f"{i}.png").write_bytes(image_bytes(w, h, seed=i))
        (root / f"{i}.txt").write_text(cap)
    build_shards(ShardsConfig(src=root, out=tmp_path / "ds", samples_per_shard=3, workers=1))
    rep = dataset_stats(tmp_path / "ds", top=3)
    assert rep["samples"] == 4 and rep["shards"] == 2
    # word counts 3, 3, 7, 1 (punctuation is not a word)
    assert rep["caption_words"]["mean"] == 3.5 and rep["caption_words"]["p50"] == 3 and rep["caption_words"]["p100"] == 7
    assert rep["vocabulary_size"] == 7 and rep["tokens"] == 14  # a the red cat dog and bird
    assert rep["top_words"] == [["a", 4], ["cat", 3], ["red", 2]]
    assert rep["image_shorter_side"]["p0"] == 10 and rep["image_shorter_side"]["p100"] == 48
    assert rep["image_formats"] == {"png": 4}
    assert json.loads((tmp_path / "ds" / "stats" / "report.json").read_text())["top_words"] == rep["top_words"]
    assert Image.open(tmp_path / "ds" / "stats" / "stats.png").size[0] > 100


def test_distribution_matches_numpy_quantiles():
    d = distribution(Counter([1, 2, 3, 4, 100]))
    assert d["count"] == 5 and d["mean"] == 22.0 and d["p50"] == 3.0 and d["p0"] == 1 and d["p100"] == 100
    assert d["p25"] == 2.0 and d["p75"] == 4.0
    assert distribution(Counter()) == {"count": 0}


def test_the_shards_table_has_an_examples_column_only_when_samples_were_skipped():
    from rich.console import Console

    from vlprep.report import print_shards_report

    base = {"written": 5, "shards": 1, "samples_in": 5, "skipped": {}, "skipped_examples": {}, "shards_resumed": 0,
            "elapsed_s": 1.0, "samples_per_s": 5.0}
    for skipped, shown in (({}, False), ({"undecodable": 2}, True)):
        console = Console(record=True, width=100)
        print_shards_report({**base, "skipped": skipped, "skipped_examples": {"undecodable": ["a.png", "b.png"]}},
                            console)
        text = console.export_text()
        assert ("examples" in text) is shown and ("a.png, b.png" in text) is shown and "e.g." not in text, text


def test_the_embed_line_says_how_many_images_came_from_cached_tokens():
    """`vlprep embed` on a dataset with cached tokens reads them where the checkpoint can: its one summary line says
    how many images took each path (and a text embedding, which has no such split, says nothing of it)."""
    from rich.console import Console

    from vlprep.report import print_embed_report

    def line(**extra) -> str:
        console = Console(record=True, width=300)
        print_embed_report({"modality": "image", "written": 9, "samples_in": 10, "dim": 16, "device": "cpu",
                            "skipped": {"no_tokens": 1}, "elapsed_s": 1.0, "per_s": 9.0, **extra}, console)
        return console.export_text().strip()

    got = line(image_input={"tokens": 7, "pixels": 2})
    assert "images from tokens 7, pixels 2; skipped no_tokens: 1" in got, got
    assert "tokens" not in line().replace("no_tokens", "")
