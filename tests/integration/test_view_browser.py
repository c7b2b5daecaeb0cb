"""vlprep view's page in a real browser: headless Debian chromium driven by Selenium, the page opened from file:// and
from --serve, checked for what a user sees (thumbnails, cards, bow words, boxes, search, paging, the detail view),
for console errors, and for a caption payload that must not run."""

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import detected_dataset, make_dataset
from vlprep.bow import BowConfig, bow
from vlprep.dataset import iter_samples
from vlprep.filter import FilterConfig, filter_dataset
from vlprep.stats import dataset_stats
from vlprep.view import ViewConfig, build_view

CHROMIUM = os.environ.get("VLPREP_CHROMIUM", "/usr/bin/chromium")
CHROMEDRIVER = os.environ.get("VLPREP_CHROMEDRIVER", "/usr/bin/chromedriver")
INSTALL = ("run `sudo bash scripts/apt-deps.sh` (Debian packages chromium and chromium-driver) and `make install` "
           "(selenium, in the [test] extra)")
STOP = set((Path(__file__).parents[2] / "vlprep/data/stopwords/english").read_text().split())
PAYLOAD = '<script>window.__pwned=1</script> <img src=x onerror="window.__pwned=1"> caught'
BOW_CAPTIONS = ["the dog is on the grass", "a cat sleeps in the sun", "the man and his dog walk",
                "a red car on the road", "two birds in a tree"]


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    """A headless chromium; a missing browser, driver or selenium fails (never skips) with how to install them."""
    missing = [p for p in (CHROMIUM, CHROMEDRIVER) if not shutil.which(p)]
    if missing:
        pytest.fail(f"{', '.join(missing)} not found: {INSTALL}", pytrace=False)
    try:
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service
    except ImportError:
        pytest.fail(f"selenium is not installed: {INSTALL}", pytrace=False)
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                "--window-size=1280,1000"):
        options.add_argument(arg)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    # chromium leaves its singleton socket's folder (org.chromium.Chromium.*) in TMPDIR after quitting: keep it in
    # pytest's temporary folder, not the machine's /tmp
    env = {**os.environ, "TMPDIR": str(tmp_path_factory.mktemp("chromium-tmp"))}
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER, env=env), options=options)
    yield driver
    driver.quit()


@pytest.fixture(scope="module")
def pages(tmp_path_factory):
    """Pages of a detect dataset (with a payload caption), a bow dataset and a 60-sample dataset."""
    tmp = tmp_path_factory.mktemp("view")
    det = detected_dataset(tmp, ["a dog on the grass", PAYLOAD, "a cat"], [["dog"], ["person"], ["cat"]])
    raw = make_dataset(tmp / "bowraw", BOW_CAPTIONS, per_shard=2)
    bow(BowConfig(src=raw, out=tmp / "bow", ops="rmstop", deform_base=True, workers=1))
    many = make_dataset(tmp / "many", [f"sample {i} {'even' if i % 2 == 0 else 'odd'}" for i in range(60)], 20)
    dataset_stats(many)  # stats/stats.png, a figure of the page
    filter_dataset(FilterConfig(src=many, out=tmp / "filtered", caption_words=":2", workers=1))
    out = {}
    for name, ds in (("det", det), ("bow", tmp / "bow"), ("many", many), ("filtered", tmp / "filtered")):
        # the filter's dropped samples come from its input as the user gives it (--input), never from meta.json
        build_view(ViewConfig(dataset=ds, out=tmp / f"view-{name}", input=many if name == "filtered" else None))
        out[name] = tmp / f"view-{name}"
    out["datasets"] = {"det": det, "bow": tmp / "bow", "many": many, "filtered": tmp / "filtered"}
    return out


def open_page(driver, url: str):
    driver.get(url)
    driver.get_log("browser")  # start each page with an empty log (the log is per session)
    driver.get(url)
    return driver


def js(driver, script: str, *args):
    return driver.execute_script(script, *args)


def no_console_errors(driver) -> None:
    errors = [e for e in driver.get_log("browser") if e["level"] in ("SEVERE", "WARNING")]
    assert errors == [], errors


def images_loaded(driver) -> list:
    return js(driver, "return [...document.querySelectorAll('.card img')].map(i => i.complete && i.naturalWidth)")


def test_detect_page_from_file_shows_every_card_its_boxes_and_no_payload_runs(browser, pages):
    d = open_page(browser, (pages["det"] / "index.html").as_uri())
    loaded = images_loaded(d)
    assert len(loaded) == 3 and all(w and w > 0 for w in loaded)
    assert js(d, "return document.querySelectorAll('.card').length") == 3
    # the dog box [0, 0, 0.5, 1] on a 16 x 16 thumbnail: the rect is (0, 0, 8, 16) in the thumbnail's pixels, and on
    # screen it covers the left half of the image as displayed
    dog = js(d, """const c = document.querySelector('.card[data-key="shard_000000000"]');
        const r = c.querySelector('rect'); const img = c.querySelector('img').getBoundingClientRect();
        const box = r.getBoundingClientRect();
        return {attrs: ['x', 'y', 'width', 'height'].map(a => Number(r.getAttribute(a))), label: r.dataset.label,
                text: c.querySelector('.box-label').textContent, img: [img.left, img.top, img.width, img.height],
                box: [box.left, box.top, box.width, box.height]};""")
    w = 16
    h = 16
    assert dog["attrs"] == [0 * w, 0 * h, (0.5 - 0) * w, (1 - 0) * h] and dog["label"] == "dog"
    assert dog["text"] == "dog 0.90"
    left, top, width, height = dog["img"]
    expected = [left + 0 * width, top + 0 * height, 0.5 * width, 1 * height]
    assert all(abs(a - b) <= 1.0 for a, b in zip(dog["box"], expected)), (dog["box"], expected)  # 1 CSS px: strokes
    # the payload is text on the card, and nothing of it ran
    text = js(d, "return document.querySelector('.card[data-key=\"shard_000000001\"] .caption').textContent")
    assert text == PAYLOAD and js(d, "return window.__pwned === undefined")
    assert js(d, "return document.querySelectorAll('.card img').length") == 3  # the payload's <img> is not an element
    no_console_errors(d)


def test_bow_card_shows_both_captions_with_removed_words_struck(browser, pages):
    d = open_page(browser, (pages["bow"] / "index.html").as_uri())
    cards = js(d, """return [...document.querySelectorAll('.card')].map(c => ({key: c.dataset.key,
        deformed: c.querySelector('.deformed').textContent,
        raw: c.querySelector('.raw').textContent,
        del: [...c.querySelectorAll('.raw del')].map(e => e.textContent),
        mark: [...c.querySelectorAll('.raw mark')].map(e => e.textContent)}))""")
    truth = {s["__key__"]: s for s in iter_samples(pages["datasets"]["bow"])}
    assert len(cards) == len(BOW_CAPTIONS)
    for card in cards:
        raw = truth[card["key"]]["json"]["caption_raw"]
        assert card["deformed"] == truth[card["key"]]["txt"] and card["raw"] == raw.lower()
        assert card["del"] == [t for t in raw.lower().split() if t in STOP]  # rmstop's removals, in caption order
        assert card["mark"] == [t for t in raw.lower().split() if t not in STOP] == card["deformed"].split()
    no_console_errors(d)


def test_search_paging_and_detail_view(browser, pages):
    d = open_page(browser, (pages["many"] / "index.html").as_uri())
    count = "return document.querySelectorAll('.card').length"
    assert js(d, count) == 48 and js(d, "return document.getElementById('page').textContent") == \
        "page 1 of 2 (60 samples)"
    d.find_element("id", "next").click()
    assert js(d, count) == 12
    box = d.find_element("id", "search")
    box.send_keys("odd")
    keys = js(d, "return [...document.querySelectorAll('.card')].map(c => c.dataset.key)")
    assert keys == [s["__key__"] for s in iter_samples(pages["datasets"]["many"]) if s["txt"].endswith("odd")]
    box.clear()
    box.send_keys("shard_000000042")  # a key
    assert js(d, "return [...document.querySelectorAll('.card')].map(c => c.dataset.key)") == ["shard_000000042"]
    assert js(d, "return document.getElementById('detail').hidden")
    d.find_element("css selector", ".card").click()
    assert not js(d, "return document.getElementById('detail').hidden")
    body = js(d, "return document.getElementById('detail-body').textContent")
    assert "shard_000000042" in body and "sample 42 even" in body
    assert js(d, "const i = document.querySelector('#detail-body img'); return i.complete && i.naturalWidth") > 0
    d.find_element("id", "detail-close").click()
    assert js(d, "return document.getElementById('detail').hidden")
    d.find_element("css selector", "#figures-box summary").click()
    figures = js(d, "return [...document.querySelectorAll('#figures img')].map(i => [i.alt, i.naturalWidth])")
    assert len(figures) == 1 and figures[0][0] == "stats/stats.png" and figures[0][1] > 0
    no_console_errors(d)


def test_the_served_page_is_the_same_page(browser, pages, tmp_path):
    ds = pages["datasets"]["det"]
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[2])}
    proc = subprocess.Popen([sys.executable, "-m", "vlprep.cli", "view", str(ds), "--out", str(tmp_path / "out"),
                             "--serve", "--port", "0"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env)
    try:
        line = proc.stdout.readline()
        url = re.fullmatch(r"serving (http://127\.0\.0\.1:\d+/index\.html) \(Ctrl-C stops\)\n", line)
        assert url, line + proc.stderr.read() if proc.poll() is not None else line
        d = open_page(browser, url.group(1))
        loaded = images_loaded(d)
        assert len(loaded) == 3 and all(w and w > 0 for w in loaded)
        assert js(d, "return window.__pwned === undefined")
        no_console_errors(d)
    finally:
        proc.terminate()
        proc.communicate(timeout=60)


def test_a_filter_page_marks_its_dropped_samples_with_the_rule(browser, pages):
    d = open_page(browser, (pages["filtered"] / "index.html").as_uri())
    # every caption has 3 words ("sample i even"), so --caption-words :2 dropped all 60: the page shows 60 of them
    dropped = js(d, """return [...document.querySelectorAll('.card.dropped')].map(c => [c.dataset.key,
        c.querySelector('.dropped-why').textContent, c.querySelector('img').naturalWidth])""")
    assert len(dropped) == 48 and js(d, "return document.querySelectorAll('.card').length") == 48
    assert all(why.startswith("dropped by caption_words: 3 words") and w > 0 for _, why, w in dropped)
    assert "then 60 of the samples the filter dropped" in js(d, "return document.getElementById('summary').textContent")
    no_console_errors(d)


def test_ontology_page_maps_each_noun_to_its_class(browser, tmp_path):
    """The real stage (spaCy's nouns, the PMI map) on the ontology tests' detections: each card lists the caption's
    nouns with the class ontology.json maps them to and its PMI, and the PMI heatmap is a figure."""
    from tests.vlprep.test_ontology import CAPTIONS, OBJECTS
    from vlprep.ontology import OntologyConfig, ontology

    det = detected_dataset(tmp_path, CAPTIONS, OBJECTS)
    ontology(OntologyConfig(src=det, out=tmp_path / "onto", min_cooccur=1, min_instances=2, workers=1))
    build_view(ViewConfig(dataset=tmp_path / "onto", out=tmp_path / "view"))
    onto = json.loads((tmp_path / "onto" / "ontology.json").read_text())
    mapping = onto["noun_to_class"]
    d = open_page(browser, (tmp_path / "view" / "index.html").as_uri())
    shown = js(d, """return Object.fromEntries([...document.querySelectorAll('.card')].map(c => [c.dataset.key,
        [...c.querySelectorAll('.nouns li')].map(li => li.textContent)]))""")
    samples = list(iter_samples(tmp_path / "onto"))
    assert len(shown) == len(samples) == len(CAPTIONS)
    for s in samples:
        nouns = [n[0] for n in s["json"]["nouns"]]
        items = shown[s["__key__"]]
        assert len(items) == len(nouns)
        for n, text in zip(nouns, items):
            if n not in mapping:
                assert text == n
                continue
            # "noun → class (PMI x.xx)": the PMI to 2 decimals, read back as a number (toFixed's rounding aside)
            m = re.fullmatch(rf"{re.escape(n)} \u2192 {re.escape(mapping[n])} \(PMI (-?\d+\.\d\d)\)", text)
            assert m and abs(float(m.group(1)) - onto["noun_pmi"][n]) <= 0.005 + 1e-9, (text, onto["noun_pmi"][n])
    assert [t.split(" (PMI")[0] for t in shown["shard_000000001"][:2]] == ["dog \u2192 dog", "man \u2192 person"]
    d.find_element("css selector", "#figures-box summary").click()
    assert js(d, "return [...document.querySelectorAll('#figures img')].map(i => [i.alt, i.naturalWidth > 0])") == \
        [["pmi_heatmap.png", True]]
    no_console_errors(d)


def test_the_page_policy_blocks_markup_that_reached_the_page_anyway(browser, pages, tmp_path):
    """Defence in depth: were a payload ever written into the page as markup, its Content-Security-Policy (the
    page's own script alone, by its hash) keeps an inline handler and an inline script from running."""
    shutil.copytree(pages["det"], tmp_path / "copy")
    page = tmp_path / "copy" / "index.html"
    injected = '<img src=x onerror="window.__pwned=1"><script>window.__pwned=2</script>'
    page.write_text(page.read_text().replace('<main id="cards"></main>', f'<main id="cards"></main>{injected}'))
    d = open_page(browser, page.as_uri())
    assert js(d, "return window.__pwned === undefined") and js(d, "return document.querySelectorAll('.card').length") == 3
    blocked = [e["message"] for e in d.get_log("browser") if "Content Security Policy" in e["message"]]
    assert len(blocked) == 2, blocked
