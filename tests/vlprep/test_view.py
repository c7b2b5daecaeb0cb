"""vlprep view without a browser: the seeded stratified draw, reading only the drawn samples, the page's records and
escaping, path-like keys, OUT's rules and --serve's server (tests/integration/test_view_browser.py opens the page)."""

import io
import json
import re
import tarfile
import threading
import urllib.request
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from tests.conftest import detected_dataset, image_bytes, make_dataset
from tests.vlprep.test_cli_bounds import error_line
from vlprep import VlprepError
from vlprep.dataset import ShardFormatError, iter_samples, open_dataset
from vlprep.tario import TarReader
from vlprep.view import ViewConfig, allocate, build_view, draw, make_server, thumb_name
from vlprep.viewpage import bow_words, sample_record, script_json

PAYLOAD = '</script><script>window.__pwned=1</script> <img src=x onerror="window.__pwned=1"> <!-- & \u2028'


def page_data(out: Path) -> dict:
    """The JSON block of OUT/index.html, parsed as the page's JSON.parse would."""
    text = (out / "index.html").read_text(encoding="utf-8")
    block = re.search(r'<script type="application/json" id="vlprep-data">(.*?)</script>', text, re.S).group(1)
    return json.loads(block)


@pytest.fixture
def three_shards(tmp_path) -> Path:
    """30 samples in shards of 10, 10 and 10, captions 'caption number i'."""
    return make_dataset(tmp_path / "ds", [f"caption number {i}" for i in range(30)], per_shard=10)


# --- the draw ------------------------------------------------------------------------------------------------------


def test_allocation_is_the_largest_remainder_split_with_random_ties():
    sizes = [10, 10, 5, 7]
    counts = allocate(sizes, 8, np.random.default_rng(0))
    # quotas 8 * s / 32 = 2.5, 2.5, 1.25, 1.75: floors 2, 2, 1, 1 (6); the 2 left go to the largest remainders, .75
    # (shard 3) and one of the two .5 (shards 0 and 1, a tie)
    assert sum(counts) == 8 and counts[2] == 1 and counts[3] == 2 and sorted(counts[:2]) == [2, 3]
    for seed in range(20):
        c = allocate(sizes, 8, np.random.default_rng(seed))
        assert all(int(8 * s / 32) <= k <= int(8 * s / 32) + 1 for s, k in zip(sizes, c))
    # 200 of 1,000 equal shards: one each for a random 200, not the first 200; another seed, another 200
    a = allocate([10] * 1000, 200, np.random.default_rng(1))
    b = allocate([10] * 1000, 200, np.random.default_rng(2))
    assert sorted(set(a)) == [0, 1] and sum(a) == 200 and a != [1] * 200 + [0] * 800 and a != b
    assert allocate([3, 0, 2], 9, np.random.default_rng(0)) == [3, 0, 2]  # n past the total: everything


def test_draw_is_seeded_stratified_and_unique(three_shards):
    ds = open_dataset(three_shards)
    picks = draw(ds, 9, seed=5)
    assert picks == draw(ds, 9, seed=5)
    assert {s: len(p) for s, p in picks.items()} == {s: 3 for s in ds.shards}  # 9 over three equal shards
    assert all(p == sorted(set(p)) and 0 <= p[0] and p[-1] < 10 for p in picks.values())
    assert any(draw(ds, 9, seed=s) != picks for s in range(6, 10))
    assert draw(ds, 100, seed=0) == {s: list(range(10)) for s in ds.shards}


def test_only_the_drawn_samples_are_read(three_shards, tmp_path, monkeypatch):
    """The bytes read through TarReader.read are exactly the txt, json and image members of the drawn samples, as
    tarfile lists them; no other member's payload is read."""
    reads = []
    original = TarReader.read

    def counting(self, offset, size):
        reads.append((Path(self.f.name).name, offset, size))
        return original(self, offset, size)

    monkeypatch.setattr(TarReader, "read", counting)
    report = build_view(ViewConfig(dataset=three_shards, out=tmp_path / "out", samples=4, seed=3))
    monkeypatch.undo()
    ds = open_dataset(three_shards)
    expected = []
    for shard, positions in draw(ds, 4, seed=3).items():
        with tarfile.open(three_shards / shard) as tar:
            members = [m for m in tar.getmembers() if m.isfile()]
        keys = list(dict.fromkeys(m.name.split(".")[0] for m in members))
        chosen = {keys[p] for p in positions}
        expected += [(shard, m.offset_data, m.size) for m in members if m.name.split(".")[0] in chosen]
    assert report["samples"] == 4 and sorted(reads) == sorted(expected) and len(reads) == 4 * 3


def test_cards_are_the_drawn_samples(three_shards, tmp_path):
    build_view(ViewConfig(dataset=three_shards, out=tmp_path / "out", samples=5, seed=1))
    data = page_data(tmp_path / "out")
    truth = {s["__key__"]: s for s in iter_samples(three_shards)}
    drawn = draw(open_dataset(three_shards), 5, seed=1)
    assert [(c["shard"], c["index"]) for c in data["samples"]] == [(s, i) for s, p in drawn.items() for i in p]
    for card in data["samples"]:
        assert card["captions"] == [truth[card["key"]]["txt"]]
        assert card["thumb"]["src"] == f"thumbs/{thumb_name(card['key'])}"
        assert (tmp_path / "out" / card["thumb"]["src"]).is_file()
    assert data["info"]["total"] == 30 and data["info"]["shown"] == 5 and data["info"]["stage"] == "shards"
    assert [step["stage"] for step in data["info"]["lineage"]] == ["shards", ""]  # the dataset, then its source


# --- what each card holds -------------------------------------------------------------------------------------------


def test_bow_words_strike_what_the_deformation_removed():
    assert bow_words("The red dog and the cat", "cat red dog") == [
        ["the", False], ["red", True], ["dog", True], ["and", False], ["the", False], ["cat", True]]
    # a multiset: a word kept once of twice is marked once
    assert bow_words("dog dog", "dog") == [["dog", True], ["dog", False]]


def test_records_carry_each_stage_s_fields():
    raw = {"__key__": "k_1", "txt": b"a dog", "png": b"",
           "json": json.dumps({"captions": ["a dog", "the dog runs"], "caption_raw": "a dog",
                               "objects": [{"label": "dog", "score": float("nan"), "box": [0, 0, 1, 1]}],
                               "nouns": [["dog", 2, 5]], "pseudo": True, "neighbours": ["al_1"]}).encode()}
    rec = sample_record(raw, "s.tar", 3, None, {"noun_to_class": {"dog": "animal"}, "noun_pmi": {"dog": 1.5}})
    assert rec["captions"] == ["a dog", "the dog runs"] and rec["bow_words"] == [["a", True], ["dog", True]]
    assert rec["objects"][0]["score"] is None  # NaN has no JSON form; JSON.parse would refuse the page
    assert rec["noun_classes"] == {"dog": "animal"} and rec["noun_pmi"] == {"dog": 1.5} and rec["pseudo"] is True and rec["neighbours"] == ["al_1"]
    assert sample_record({"__key__": "k", "json": b"{bad"}, "s.tar", 0, None, {})["captions"] == [""]


def test_detection_boxes_reach_the_page(tmp_path):
    det = detected_dataset(tmp_path, ["a dog", "a cat"], [["dog"], ["cat"]])
    build_view(ViewConfig(dataset=det, out=tmp_path / "out", samples=2))
    cards = page_data(tmp_path / "out")["samples"]
    assert [c["objects"] for c in cards] == [[{"label": "dog", "score": 0.9, "box": [0, 0, 0.5, 1]}],
                                            [{"label": "cat", "score": 0.9, "box": [0, 0, 0.5, 1]}]]
    assert [c["thumb"]["w"] for c in cards] == [16, 16]  # a 16 x 16 image is its own thumbnail


# --- escaping and path-like keys ------------------------------------------------------------------------------------


def test_script_json_cannot_close_its_block():
    value = {"caption": PAYLOAD}
    text = script_json(value)
    assert "<" not in text and ">" not in text and "&" not in text and "\u2028" not in text
    assert json.loads(text) == value


def test_a_payload_caption_stays_data_in_the_page(tmp_path):
    ds = make_dataset(tmp_path / "ds", [PAYLOAD, "plain"], per_shard=2)
    build_view(ViewConfig(dataset=ds, out=tmp_path / "out"))
    text = (tmp_path / "out" / "index.html").read_text()
    before, _, rest = text.partition('id="vlprep-data">')
    block, _, after = rest.partition("</script>")
    assert "<" not in block and "pwned" not in before + after and text.count("<script") == 2
    captions = [c["captions"][0] for c in page_data(tmp_path / "out")["samples"]]
    assert captions[0] == " ".join(PAYLOAD.split())  # shards collapse whitespace; nothing else changed


def write_raw_dataset(folder: Path, names: list[str]) -> Path:
    """A one-shard dataset written by hand whose sample keys are `names` (member paths, as a foreign tar has)."""
    folder.mkdir()
    with tarfile.open(folder / "x-000000.tar", "w") as tar:
        for i, key in enumerate(names):
            for ext, data in (("png", image_bytes(8, 8, seed=i)), ("txt", f"caption {i}".encode())):
                info = tarfile.TarInfo(f"{key}.{ext}")
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    (folder / "sizes.json").write_text(json.dumps({"x-000000.tar": len(names)}))
    return folder


def test_keys_that_look_like_paths_write_nothing_outside_out(tmp_path):
    keys = ["etc/passwd", "sub/dir/index", "%2e%2e%2fup", "C:\\win"]
    ds = write_raw_dataset(tmp_path / "ds", keys)
    before = {p for p in tmp_path.rglob("*")}
    build_view(ViewConfig(dataset=ds, out=tmp_path / "out"))
    written = {p for p in tmp_path.rglob("*")} - before
    assert all(p.is_relative_to(tmp_path / "out") for p in written)
    thumbs = sorted(p.name for p in (tmp_path / "out" / "thumbs").iterdir())
    assert thumbs == sorted(thumb_name(k) for k in keys) and all(re.fullmatch(r"[0-9a-f]{20}\.jpg", t) for t in thumbs)
    assert [c["key"] for c in page_data(tmp_path / "out")["samples"]] == keys


def test_a_member_that_climbs_out_is_refused(tmp_path):
    ds = write_raw_dataset(tmp_path / "ds", ["ok", "../../evil"])
    with pytest.raises(ShardFormatError, match=r"unsafe member name '../../evil.png'"):
        build_view(ViewConfig(dataset=ds, out=tmp_path / "out"))
    assert not (tmp_path / "evil.png").exists() and not list((tmp_path / "out" / "thumbs").iterdir())


# --- OUT, options and --serve ---------------------------------------------------------------------------------------


def test_a_second_view_replaces_the_first(three_shards, tmp_path):
    build_view(ViewConfig(dataset=three_shards, out=tmp_path / "out", samples=3, seed=0))
    build_view(ViewConfig(dataset=three_shards, out=tmp_path / "out", samples=2, seed=1))
    keys = [c["key"] for c in page_data(tmp_path / "out")["samples"]]
    assert sorted(p.name for p in (tmp_path / "out" / "thumbs").iterdir()) == sorted(map(thumb_name, keys))


def test_default_out_is_dataset_view(three_shards):
    report = build_view(ViewConfig(dataset=three_shards, samples=1))
    assert report["out"] == str(three_shards / "view") and (three_shards / "view" / "index.html").is_file()
    assert open_dataset(three_shards).num_samples == 30  # the dataset still opens


@pytest.mark.parametrize("args,says", [
    (["--samples", "0"], "error: --samples must be between 1 and 100,000, not 0"),
    (["--seed", "-1"], "error: --seed must be >= 0, not -1"),
    (["--serve", "--port", "70000"], "error: --port must be between 0 and 65535, not 70000"),
    (["--out", "{ds}"], "error: --out {ds} is (or holds) the dataset folder; give another folder"),
    (["--out", "{foreign}"], "error: --out {foreign} holds files that `vlprep view` did not write; give an empty or "
                             "new folder"),
])
def test_bad_options_are_one_line(three_shards, tmp_path, args, says, vlprep):
    foreign = tmp_path / "mine"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")
    fill = {"ds": three_shards, "foreign": foreign}
    r = vlprep("view", three_shards, *[a.format(**fill) for a in args])
    assert error_line(r) == says.format(**fill)
    assert (foreign / "notes.txt").read_text() == "mine" and not (three_shards / "view").exists()


def test_urls_are_refused_where_only_a_folder_can_go(three_shards, tmp_path, vlprep):
    r = vlprep("view", three_shards, "--out", "s3://bucket/view")
    assert error_line(r) == ("error: --out s3://bucket/view: only dataset folders may be URLs (s3://, gs://, "
                             "http(s)://); give a local path")
    r = vlprep("view", "ftp://host/ds", "--out", tmp_path / "out")
    assert error_line(r) == ("error: DATASET ftp://host/ds: unsupported URL scheme ftp://; use s3://, gs://, "
                             "http(s):// or file://")
    assert not (tmp_path / "out").exists()


def test_a_url_dataset_needs_out(tmp_path):
    with pytest.raises(VlprepError, match="is a URL: give --out"):
        build_view(ViewConfig(dataset="s3://bucket/ds"))


def test_serve_serves_out_on_localhost(three_shards, tmp_path):
    build_view(ViewConfig(dataset=three_shards, out=tmp_path / "out", samples=2))
    server = make_server(tmp_path / "out", 0)
    thread = threading.Thread(target=server.serve_forever)
    thread.start()
    try:
        host, port = server.server_address
        assert host == "127.0.0.1" and port > 0
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/index.html", timeout=30) as r:
            assert r.read() == (tmp_path / "out" / "index.html").read_bytes()
        with pytest.raises(VlprepError, match=f"cannot serve on 127.0.0.1:{port} .*--port 0 for any free one"):
            make_server(tmp_path / "out", port)
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


def test_a_short_shard_is_one_error(tmp_path):
    ds = write_raw_dataset(tmp_path / "ds", ["a", "b"])
    (ds / "sizes.json").write_text(json.dumps({"x-000000.tar": 5}))
    with pytest.raises(VlprepError, match=r"x-000000.tar: the tar holds 2 samples, sizes.json says 5"):
        build_view(ViewConfig(dataset=ds, out=tmp_path / "out", samples=5))


def test_every_sample_has_a_card_when_n_exceeds_the_total(three_shards, tmp_path):
    build_view(ViewConfig(dataset=three_shards, out=tmp_path / "out", samples=1000))
    keys = [c["key"] for c in page_data(tmp_path / "out")["samples"]]
    assert keys == [s["__key__"] for s in iter_samples(three_shards)] and Counter(keys).most_common(1)[0][1] == 1


# --- pseudolabel's neighbours, and a dataset at a URL ---------------------------------------------------------------


def test_pseudo_cards_hold_their_neighbours_captions(tmp_path):
    from tests.conftest import COLOURS, THINGS, tiny_checkpoint
    from vlprep.pseudolabel import PseudolabelConfig, pseudolabel
    from vltrain.checkpoint_encoder import CheckpointEncoder

    caps = [f"A {COLOURS[i % 6]} {THINGS[i % 8]} and the {THINGS[(i * 3 + 1) % 8]}, number {i}" for i in range(12)]
    aligned = make_dataset(tmp_path / "aligned", caps, 4, prefix="al")
    unaligned = make_dataset(tmp_path / "unaligned", ["x"] * 4, 2, seed=500, prefix="un")
    enc = CheckpointEncoder(tiny_checkpoint(tmp_path / "ckpt.pt"), "cpu")
    pseudolabel(PseudolabelConfig(aligned=aligned, unaligned=unaligned, out=tmp_path / "pl", k=3, crops=2,
                                  batch_size=4, device="cpu", workers=1), enc)
    build_view(ViewConfig(dataset=tmp_path / "pl", out=tmp_path / "out", aligned=aligned))
    truth = {s["__key__"]: s["txt"] for s in iter_samples(aligned)}
    pseudo = {s["__key__"]: s for s in iter_samples(tmp_path / "pl")}
    cards = page_data(tmp_path / "out")["samples"]
    assert len(cards) == 4
    for card in cards:
        assert card["pseudo"] is True and card["captions"] == [pseudo[card["key"]]["txt"]]
        assert card["neighbours"] == pseudo[card["key"]]["json"]["neighbours"] and len(card["neighbours"]) == 3
        assert card["neighbour_captions"] == [truth[k] for k in card["neighbours"]]


def test_neighbour_lookup_reads_only_sidecars_whose_key_range_holds_one(tmp_path, monkeypatch):
    import pyarrow.parquet as pq

    from vlprep.view import neighbour_captions

    aligned = make_dataset(tmp_path / "al", [f"caption {i}" for i in range(12)], 4, prefix="al")
    read = []
    original = pq.ParquetFile.read

    def counting(self, *a, **kw):
        read.append(1)
        return original(self, *a, **kw)

    monkeypatch.setattr(pq.ParquetFile, "read", counting)
    found = neighbour_captions(aligned, {"al_000000005", "al_000000006", "nope"})
    assert found == {"al_000000005": "caption 5", "al_000000006": "caption 6"} and len(read) == 1
    assert neighbour_captions(tmp_path / "missing", {"al_000000005"}) == {}


def test_a_dataset_at_an_http_url_gives_the_same_cards(three_shards, tmp_path):
    from tests.integration.servers import http_server, need

    need("fsspec", "aiohttp")
    build_view(ViewConfig(dataset=three_shards, out=tmp_path / "local", samples=6, seed=2))
    with http_server(three_shards.parent) as (base, _):
        build_view(ViewConfig(dataset=f"{base}/ds/", out=tmp_path / "remote", samples=6, seed=2))
    local = page_data(tmp_path / "local")
    remote = page_data(tmp_path / "remote")
    assert remote["samples"] == local["samples"] and remote["info"]["dataset"].startswith("http://127.0.0.1:")
    for card in remote["samples"]:
        src = card["thumb"]["src"]
        assert (tmp_path / "remote" / src).read_bytes() == (tmp_path / "local" / src).read_bytes()


def test_a_filter_output_shows_a_draw_of_its_dropped_samples_with_the_rule(tmp_path):
    from vlprep.filter import FilterConfig, filter_dataset

    captions = [("one two three four" if i % 3 else "short") + f" {i}" for i in range(24)]
    raw = make_dataset(tmp_path / "raw", captions, per_shard=8)
    filter_dataset(FilterConfig(src=raw, out=tmp_path / "clean", caption_words="3:", workers=1))
    report = build_view(ViewConfig(dataset=tmp_path / "clean", out=tmp_path / "out", samples=5, seed=4, input=raw))
    data = page_data(tmp_path / "out")
    kept = [c for c in data["samples"] if "dropped" not in c]
    drops = [c for c in data["samples"] if "dropped" in c]
    truth = {s["__key__"]: s for s in iter_samples(raw)}
    assert report["samples"] == len(kept) == 5 and report["dropped"] == len(drops) == 5
    assert data["info"]["dropped_shown"] == 5
    assert all(len(c["captions"][0].split()) >= 3 for c in kept)
    for card in drops:  # each read from the filter's input, with its rule and the detail the filter wrote
        assert card["captions"] == [truth[card["key"]]["txt"]] and card["captions"][0].startswith("short")
        assert card["dropped"]["rule"] == "caption_words" and card["dropped"]["detail"].startswith("2 words")
        assert (tmp_path / "out" / card["thumb"]["src"]).is_file()
    assert len({c["key"] for c in drops}) == 5


def test_the_dataset_s_figures_are_copied_for_the_page(three_shards, tmp_path):
    from vlprep.stats import dataset_stats

    dataset_stats(three_shards, out=None)  # its default: DATASET/stats/{report.json,stats.png}
    (three_shards / "clip_score.png").write_bytes((three_shards / "stats" / "stats.png").read_bytes()[:100])
    (three_shards / "odd name.png").write_bytes(b"x")
    build_view(ViewConfig(dataset=three_shards, out=tmp_path / "out", samples=2))
    figures = page_data(tmp_path / "out")["info"]["figures"]
    assert figures == [{"src": "figures/clip_score.png", "name": "clip_score.png"},
                       {"src": "figures/stats.png", "name": "stats/stats.png"}]
    for f, source in zip(figures, ("clip_score.png", "stats/stats.png")):
        assert (tmp_path / "out" / f["src"]).read_bytes() == (three_shards / source).read_bytes()
    assert sorted(p.name for p in (tmp_path / "out" / "figures").iterdir()) == ["clip_score.png", "stats.png"]


def test_memory_does_not_grow_with_the_dataset(tmp_path):
    """A view of 20 samples holds a per-shard amount (sizes.json's entries, the allocation), never a structure with an
    entry per sample of the dataset."""
    from tests.memrule import growth_per_sample

    made = {}

    def run(m: int) -> None:
        if m not in made:
            made[m] = make_dataset(tmp_path / f"ds{m}", [f"caption {i}" for i in range(m)], per_shard=50)
        build_view(ViewConfig(dataset=made[m], out=tmp_path / f"out{m}", samples=20))

    assert growth_per_sample(run, 250) < 100


def test_an_image_that_does_not_decode_is_a_card_without_one_and_a_warning(tmp_path, vlprep):
    from tests.conftest import replace_member

    ds = make_dataset(tmp_path / "ds", ["a", "b", "c"], per_shard=3)
    replace_member(ds, "shard_000000001.png", b"\x89PNG not really")
    r = vlprep("view", str(ds), "--out", tmp_path / "out")
    assert r.returncode == 0, r.stderr
    assert "warning: 1 of the drawn samples have no image that decodes; their cards show none" in r.stderr
    assert f"wrote {tmp_path / 'out'}/index.html (3 of 3 samples)" in r.stderr
    cards = page_data(tmp_path / "out")["samples"]
    assert [c["thumb"] is None for c in cards] == [False, True, False] and cards[1]["captions"] == ["b"]
    assert len(list((tmp_path / "out" / "thumbs").iterdir())) == 2


def test_a_local_dataset_given_as_a_string_defaults_out_beside_it(three_shards):
    assert build_view(ViewConfig(dataset=str(three_shards), samples=1))["out"] == str(three_shards / "view")
