"""Caption cleaning of examples/openclipart/make_captions.py, on hand-written metadata and tiny SVG files."""

import importlib.util
import sys
from collections import Counter
from pathlib import Path

import pyarrow.parquet as pq
import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "examples" / "openclipart" / "make_captions.py"
_spec = importlib.util.spec_from_file_location("make_captions", SCRIPT)
mc = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(mc)

ROLLANDIN = ["Architetto Francesco Rollandin"]


@pytest.mark.parametrize("raw, expected", [
    ("L&Atilde;&copy;zard", "Lézard"),                              # escaped twice, and UTF-8 read as Latin-1
    ("Croissant (B &amp; W)", "Croissant (B & W)"),
    ("Baden-W&uuml;rttemberg", "Baden-Württemberg"),
    ('\n<!-- CC -->\n<a rel="license" href="x">Public</a>\n  domain ', "Public domain"),
    (None, ""),
])
def test_fix_text(raw, expected):
    assert mc.fix_text(raw) == expected


@pytest.mark.parametrize("title, creators, expected", [
    ("provetta_plasma_sangue", [], "provetta plasma sangue"),
    ("PointingHand2", [], "Pointing Hand 2"),
    ("Tigre04", [], "Tigre"),
    ("g8", [], "g8"),
    ("arrow-up-purple", [], "arrow up purple"),
    ("glace_01", [], "glace"),
    ("05_fullmoon_openclipart", [], "fullmoon"),
    (" ireland", [], "ireland"),
    ("B_W Tiger", [], "B W Tiger"),
    ("Alcatel_4400", [], "Alcatel 4400"),
    ("45 rpm record", [], "45 rpm record"),
    ("US Capitol Building Clipart Style", [], "US Capitol Building Style"),
    ("Chalet di montagna Architetto Francesco Rollandin", ROLLANDIN, "Chalet di montagna"),
    ("Lake at night by Jane Doe", ["Jane Doe"], "Lake at night"),
])
def test_clean_title(title, creators, expected):
    assert mc.clean_title(title, creators) == expected


@pytest.mark.parametrize("stem, creators, expected", [
    ("acquila_architetto_franc_01", ROLLANDIN, "acquila"),
    ("people_juliane_krug_01a", ["Juliane Krug"], "people"),
    ("arrow04_2", [], "arrow"),
    ("2uparrow", [], "uparrow"),
    ("star_67pt11step", ["codifiedivining"], "star"),
    ("w_cloud", [], "cloud"),
    ("gnome-fs-trash-empty", [], "gnome fs trash empty"),
    ("ChargesSuspendues", [], "Charges Suspendues"),
    ("k3b", [], "k3b"),
    ("x", [], "x"),
])
def test_name_from_stem(stem, creators, expected):
    assert mc.name_from_stem(stem, creators) == expected


@pytest.mark.parametrize("title, stem, creators, count, expected", [
    ("Acquila", "acquila_architetto_franc_01", ROLLANDIN, 1, "Acquila"),
    ("bored dog", "bored_dog_01", [], 1, "Bored dog"),
    # a stale credit copied to many files names another file
    ("Clipart by Nicu Buculei - contour_chipmunk", "contour_giraffe", ["Nicu Buculei"], 13, "Contour giraffe"),
    # the same credit on one file: only the credit goes
    ("Clipart by Steve Hall - United States - Alabama", "usa_alabama", ["Steve Hall"], 1, "United States - Alabama"),
    ("Part of the Flat Icon Collection (Wed Aug 25 23:29:46 2004)", "gg_away", ["Danny Allen"], 1, "Gg away"),
    ("Lemon SVG theme", "viewmag1", [], 1, "Viewmag"),
    ("gramastar", "star_67pt11step", ["codifiedivining"], 1375, "Star"),
    ("Road Signs", "drawbridge", [], 8, "Drawbridge"),
    ("Road Signs", "drawbridge", [], 4, "Road Signs"),              # under SHARED_TITLE: a title of its own
    ("Bullet Hole", "bullet_hole_linda_kim_aa", ["Linda Kim"], 13, "Bullet Hole"),   # the file name adds noise
    ("Mountain - RPG map elements", "mountain_-_rpg_map_elem_07", [], 7, "Mountain - RPG map elements"),
    ("Architetto Francesco Rollandin", "architetto_francesco_ro_01", ROLLANDIN, 2, "Architetto"),
    ("", "hummer_02", [], 62, "Hummer"),
])
def test_pick_name(title, stem, creators, count, expected):
    assert mc.pick_name(title, stem, creators, count) == expected


@pytest.mark.parametrize("desc, name, count, expected", [
    ("", "Dog", 1, ""),
    ("Map of Norway", "Map of Norway", 1, ""),
    ("a news paper", "Newspaper", 1, ""),
    ("Beige joystick", "Joystick beige gray", 1, ""),
    ("Red and white striped lighthouse", "Lighthouse", 1, "Red and white striped lighthouse"),
    ("Um carro esporte, voyeg3r@gmail.com", "Sportcar", 1, "Um carro esporte"),
    ("jean.victor.balin@gmail.com", "Glace", 1, ""),
    ("HASH(0x862bbb8)", "Ireland", 1, ""),
    ("EPS converted from  http://aiga.org", "Aiga customs", 243, ""),
    ("A simple shield", "Shield", 6, "A simple shield"),
    ("This is a standard cross drawn by pen and converted to an SVG in inkscape with the new trace tool.", "Cross", 1,
     ""),
    ("This work is hereby released into the Public Domain. A red fox, sitting.", "Fox", 1, "A red fox, sitting"),
    ("This picture shows why the North Star doesn't seem to move. (All other stars do.) I hope it helps.", "Earth",
     1, "This picture shows why the North Star doesn't seem to move"),
    ("a &quot;required&quot; <b>flask</b>", "Chemistry", 1, 'A "required" flask'),
])
def test_clean_description(desc, name, count, expected):
    assert mc.clean_description(desc, name, count) == expected


def test_clean_description_keeps_30_words():
    long = " ".join(f"word{i}" for i in range(40)) + ". Second sentence."
    assert mc.clean_description(long, "Thing", 1) == "Word0 " + " ".join(f"word{i}" for i in range(1, 30))


def test_split_keywords():
    raw = ["", "hash", "hash(0x8a393fc)", "0x8b754fc", "11", "clip art", "Clipart", "unsorted", "rome,italy",
           "united_nations_member", "architetto francesco rollandin", "www.lumenstudio.net", "snu@autistici.org",
           "cayennepepperfoodspicyhot", "santa claus", "Flag", "flag ", "signs_and_symbols"]
    assert mc.split_keywords(raw, ROLLANDIN) == ["rome", "italy", "united nations member", "santa claus", "flag"]


def test_pick_keywords_drops_repeats_and_ranks_by_corpus_frequency():
    freq = Counter({"animal": 200, "green": 60, "frog": 30, "frogs": 5, "froggies": 1})
    keywords = ["froggies", "frogs", "dead", "animal", "frog", "green", "kwaakwaa"]
    # 'frogs', 'frog' (plural folded) and 'dead' are in the name; ties keep source order
    assert mc.pick_keywords(keywords, "2 dead frogs", freq) == ["animal", "green", "froggies", "kwaakwaa"]
    many = [f"k{c}" for c in "abcdefgh"]
    assert mc.pick_keywords(many, "Thing", Counter()) == many[:mc.MAX_KEYWORDS]


@pytest.mark.parametrize("name, desc, keywords, expected", [
    ("Acquila", "", ["eagle", "bird", "animal"], "Acquila. eagle, bird, animal"),
    ("Lighthouse", "Red and white striped lighthouse", [], "Lighthouse. Red and white striped lighthouse"),
    ("", "", ["icon"], "icon"),
    ("", "", [], ""),
])
def test_make_caption(name, desc, keywords, expected):
    assert mc.make_caption(name, desc, keywords) == expected


SVG = """<?xml version="1.0" encoding="UTF-8" standalone="no"?>
<svg xmlns="http://www.w3.org/2000/svg" xmlns:cc="http://web.resource.org/cc/"
     xmlns:dc="http://purl.org/dc/elements/1.1/" xmlns:rdf="http://www.w3.org/1999/02/22-rdf-syntax-ns#">
  <metadata><rdf:RDF><cc:Work rdf:about="">
    <dc:title>{title}</dc:title>
    <dc:description>{description}</dc:description>
    <dc:subject><rdf:Bag>{keywords}</rdf:Bag></dc:subject>
    <dc:publisher><cc:Agent><dc:title>Open Clip Art Library</dc:title></cc:Agent></dc:publisher>
    <dc:creator><cc:Agent><dc:title>{creator}</dc:title></cc:Agent></dc:creator>
  </cc:Work></rdf:RDF></metadata>
  <rect width="10" height="10"/>
</svg>
"""


def write_svg(root: Path, rel: str, text: str, png: bool = True) -> None:
    svg = root / "svg" / f"{rel}.svg"
    svg.parent.mkdir(parents=True, exist_ok=True)
    svg.write_text(text, encoding="utf-8")
    if png:  # the script only checks that the PNG exists; vlprep shards reads it later
        (root / "png" / f"{rel}.png").parent.mkdir(parents=True, exist_ok=True)
        (root / "png" / f"{rel}.png").write_bytes(b"\x89PNG\r\n\x1a\n")


def svg_text(title, description, keywords, creator):
    return SVG.format(title=title, description=description, creator=creator,
                      keywords="".join(f"<rdf:li>{k}</rdf:li>" for k in keywords))


@pytest.fixture
def clipart(tmp_path: Path) -> Path:
    write_svg(tmp_path, "animals/birds/acquila_architetto_franc_01",
              svg_text("Acquila", "Acquila", ["bird", "animal", "clip art", "architetto francesco rollandin", "eagle"],
                       ROLLANDIN[0]))
    write_svg(tmp_path, "food/croissant_b_amp_w__geral_01",
              svg_text("Croissant (B &amp;amp; W)",  # escaped twice, as in the real file
                       "A croissant &lt;b&gt;fresh&lt;/b&gt; from the oven. Drawn with Inkscape. http://example.com",
                       ["food", "Croissant", "hash(0x8a393fc)", "animal", "bread"], "Gerald G."))
    write_svg(tmp_path, "unsorted/broken", "<svg><metadata><dc:title>oops</svg>")  # malformed
    write_svg(tmp_path, "shapes/plain", '<svg xmlns="http://www.w3.org/2000/svg"><rect/></svg>')
    write_svg(tmp_path, "shapes/button.rss", svg_text("RSS", "", ["web"], "X"), png=False)
    return tmp_path


def run_script(monkeypatch, root: Path, *extra: str) -> Path:
    out = root / "out" / "captions.parquet"
    monkeypatch.setattr(sys, "argv", ["make_captions.py", "--svg-root", str(root / "svg"),
                                      "--png-root", str(root / "png"), "--out", str(out), *extra])
    mc.main()
    return out


def test_script_on_tiny_svgs(clipart, monkeypatch, capsys):
    rows = pq.read_table(run_script(monkeypatch, clipart)).to_pylist()
    # 'animal' is on two files, so it comes first; the rest keep source order
    assert [r["caption"] for r in rows] == ["Acquila. animal, bird, eagle",
                                            "Croissant (B & W). A croissant fresh from the oven. animal, food, bread"]
    assert rows[0] == {"image": str(clipart / "png/animals/birds/acquila_architetto_franc_01.png"),
                       "caption": "Acquila. animal, bird, eagle", "uid": "animals/birds/acquila_architetto_franc_01",
                       "title": "Acquila", "keywords": ["animal", "bird", "eagle"], "category": "animals",
                       "description": ""}
    assert rows[1]["description"] == "A croissant fresh from the oven"  # a text of its own: make_karpathy.py
    out = capsys.readouterr().out
    assert "2 rows (2 distinct captions)" in out
    assert "skipped: no_png 1, malformed_xml 1, no_metadata 1, empty_caption 0" in out


def test_script_limit_is_evenly_spaced(clipart, monkeypatch, capsys):
    # sorted: animals/..acquila, food/..croissant, shapes/button.rss, shapes/plain, unsorted/broken -> indices 0, 2
    rows = pq.read_table(run_script(monkeypatch, clipart, "--limit", "2")).to_pylist()
    assert [r["uid"] for r in rows] == ["animals/birds/acquila_architetto_franc_01"]
    out = capsys.readouterr().out
    assert "1 rows (1 distinct captions)" in out and "from 2 SVGs" in out and "no_png 1" in out
