"""Captions for Debian's openclipart clip art: one Parquet row per PNG, from its SVG's RDF metadata.

Caption: "<Name>. <Description>. <kw1>, <kw2>, ..." with empty parts left out, e.g. "Acquila. bird" or
"Lighthouse. Red and white striped lighthouse. transport, building, boat, house, ocean, navigation". Name: the cleaned
<dc:title>; Description: one sentence of <dc:description>; keywords: <dc:subject>. Creator/publisher are not used.

Cleaning rules (rule: reason):
- unescape HTML twice, repair UTF-8 read as Latin-1, drop tags: exporters escaped twice ("L&Atilde;&copy;zard").
- titles: drop a "Clipart by X - " credit, the creator's name and the word "clipart": credits, true of every file.
- a "Clipart by X - name" title on several files is stale: it names another file (all say "contour_chipmunk").
- titles "Part of ...", "... theme", "... iconset" or shared by >= 5 files name a pack ("gramastar" x1375):
  the file name is used instead, unless it only adds noise ("bullet_hole_linda_kim_aa" for "Bullet Hole").
- file names: split on _-.+ and camelCase; drop counters, 1-letter tokens, later codes ("67pt11step") and
  creator-name prefixes: Debian names files "<title>_<creator, truncated>_NN".
- titles without spaces ("provetta_plasma_sangue", "PointingHand2") are split the same way: they are file names.
- zero-padded counters ("glace_01") are dropped from titles: they number files, not things.
- descriptions lose URLs, e-mails, "clipart" and Perl "HASH(0x...)" dumps: contacts, the medium, exporter bugs.
- description sentences about tools, licences or contacts (Inkscape, EPS, public domain) are dropped: not content.
- only the first remaining sentence is kept, at most 30 words: long histories drown the caption.
- a description on >= 10 files is dropped: pack boilerplate ("EPS converted from http://aiga.org" x243).
- a description that repeats the title ("Map of Norway", "a news paper" for "Newspaper") is dropped.
- keywords: lowercased, split on , and ;, "_" -> " ": "rome,italy", "united_nations_member".
- keywords without a letter, with a URL/e-mail/0x..., or one token > 20 chars are dropped: exporter noise and
  run-together tag lists ("cayennepepperfoodspicyhot").
- STOP keywords (clipart, unsorted, svg, theme, icon-theme folders...) and the creator's name are dropped: they
  describe the file, not the picture ("architetto francesco rollandin" x58).
- keywords already in the name or in a kept keyword (plurals folded: frogs = frog) are dropped: no repeats.
- the 6 keywords most frequent in the corpus are kept (ties: source order): shared tags are real, general words;
  one-off tags are often jokes or typos ("kwaakwaa"); and the caption stays short.

--limit N keeps N evenly spaced files of the sorted SVG list (index i * total // N): deterministic, all categories.
Counts (shared titles, keyword frequencies) always come from all files: a caption does not depend on N.

Besides the caption, the table keeps its three parts apart (title, description, keywords: '' or [] when empty), so
make_karpathy.py can turn them into several independent captions of one image. The description column is last:
the columns before it, and every caption, are the same as before it was added.
"""

import argparse
import html
import re
import time
import xml.etree.ElementTree as ET
from collections import Counter
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
from rich.console import Console
from rich.progress import track

SHARED_TITLE, SHARED_DESC = 5, 10  # "A simple shield" on 6 variants of a shield still describes each one
MAX_WORDS, MAX_KEYWORDS = 30, 6
STOP = {"unsorted", "clip art", "clipart", "clip-art", "media", "public domain", "image", "png", "svg", "eps",
        "externalsource", "hash", "theme", "magick", "lemon theme icon", "mimetypes", "mime-types", "mime types",
        "mimeicon", "appicon", "action", "application", "filesystem", "device", "special", "signs and symbols",
        "examples", "mapsym", "map symbol", "networksym", "misc", "other", "various"}
PACK = re.compile(r"^part of\b|\btheme$|\bicon ?set$", re.I)
CREDIT = re.compile(r"^clip ?art by .+? - ", re.I)
NOISE = re.compile(r"https?://\S+|www\.\S+|\S+@\S+|hash\(0x[0-9a-f]+\)|\b0x[0-9a-f]+\b|\b(open)?clip ?art\b",
                   re.I)
OFF_TOPIC = re.compile(r"\b(inkscape|sodipodi|illustrator|corel|svg|eps|converted|public domain|licen[cs]e|"
                       r"copyright|creative commons|released|contact|(created|made|drawn) (with|in|by))\b", re.I)
REASONS = ("no_png", "malformed_xml", "no_metadata", "empty_caption")


def fix_text(s: str | None) -> str:
    """Unescape (twice-)escaped HTML, repair UTF-8 read as Latin-1, drop tags, collapse whitespace."""
    s = html.unescape(html.unescape(s or ""))
    try:
        s = s.encode("latin-1").decode("utf-8")
    except UnicodeError:
        pass  # not mojibake: keep as is
    return re.sub(r"\s+", " ", re.sub(r"<!--.*?-->|<[^>]*>", " ", s, flags=re.S)).strip()


def words(s: str) -> list[str]:
    """Lowercase letter-only words without articles, to compare names, descriptions and keywords."""
    return [w for w in re.findall(r"[^\W\d_]+", s.lower()) if w not in ("a", "an", "the")]


def fold(word: str) -> str:
    """Naive plural folding, for comparisons only: 'frogs' -> 'frog', 'boxes' -> 'box'."""
    return re.sub(r"(es|s)$", "", word) if len(word) > 3 else word


def tokens(name: str) -> list[str]:
    """File-name-like string -> tokens: split on _ - . + whitespace and camelCase."""
    return [t for t in re.split(r"[\s_\-.+]+", re.sub(r"(?<=[a-z])(?=[A-Z])", " ", name)) if t]


def name_from_stem(stem: str, creators: list[str]) -> str:
    """'people_juliane_krug_01a' -> 'people', 'arrow04_2' -> 'arrow', 'star_67pt11step' -> 'star'."""
    creator_words = {w.lower() for c in creators for w in re.findall(r"\w+", c) if len(w) >= 3}
    kept = []
    for i, tok in enumerate(tokens(stem)):
        tok = tok.strip("0123456789")  # counters: 'arrow04' -> 'arrow', '2uparrow' -> 'uparrow'
        creator = any(w.startswith(tok.lower()) for w in creator_words)  # 'franc', 'ro' of 'Francesco Rollandin'
        if len(tok) >= 2 and not (i > 0 and (creator or re.search(r"\d", tok))):
            kept.append(tok)
    return " ".join(kept) or " ".join(tokens(stem))  # 'x' stays 'x' rather than nothing


def clean_title(title: str, creators: list[str]) -> str:
    """<dc:title> as words, without counters, 'clipart' or the creator's name."""
    title = title.strip(" _-")
    if " " in title:
        title = title.replace("_", " ")
    else:  # a file name: 'PointingHand2' -> 'Pointing Hand 2', 'Tigre04' -> 'Tigre 04' (a counter, dropped below)
        title = re.sub(r"(?<=[^\W\d_]{3})(?=\d+\b)", " ", " ".join(tokens(title)))
    title = re.sub(r"^0\d+\s+|\s+0\d+$|\b(open)?clip ?art\b", "", title, flags=re.I)
    for creator in filter(lambda c: len(c) > 2, map(str.strip, creators)):
        title = re.sub(rf"(\bby\s+)?{re.escape(creator)}", "", title, flags=re.I)
    return re.sub(r"\s+", " ", title).strip(" -.,;:")


def pick_name(title: str, stem: str, creators: list[str], title_count: int) -> str:
    """The cleaned title, or the file name when the title names a pack or a series and the file says more."""
    title = fix_text(title)
    credit = CREDIT.match(title)
    if credit:  # 'Clipart by X - Spain' is fine once; copied to many files, it names another file
        title = "" if title_count > 1 else title[credit.end():]
    name = clean_title(title, creators)
    if PACK.search(name):
        name = ""
    if not name or title_count >= SHARED_TITLE:
        from_file = name_from_stem(stem, creators)
        name_words, file_words = words(name), words(from_file)
        adds_nothing = set(name_words) <= set(file_words) or all(  # 'Bullet hole aa', 'Mountain rpg map elem'
            any(t.startswith(f) for t in name_words) for f in file_words)
        name = name if name and adds_nothing else from_file
    return name[:1].upper() + name[1:]


def clean_description(desc: str, name: str, desc_count: int) -> str:
    """First on-topic sentence of <dc:description>, at most MAX_WORDS words; '' when it says nothing new."""
    if desc_count >= SHARED_DESC:
        return ""
    for sentence in re.split(r"(?<=[.!?])\s+", NOISE.sub(" ", fix_text(desc))):
        sentence = re.sub(r"\s+", " ", sentence).strip(" .,;:!?-")
        if not re.search(r"[^\W\d_]{2}", sentence) or OFF_TOPIC.search(sentence):
            continue
        squash = lambda s: "".join(words(s))  # noqa: E731 - 'a news paper' == 'Newspaper'
        if squash(sentence) in squash(name) or {*map(fold, words(sentence))} <= {*map(fold, words(name))}:
            return ""
        sentence = " ".join(sentence.split()[:MAX_WORDS]).rstrip(" ,;:-")
        return sentence[:1].upper() + sentence[1:]
    return ""


def split_keywords(raw: list[str], creators: list[str]) -> list[str]:
    """Lowercased keywords without noise, STOP words or the creator's name; source order, no duplicates."""
    names, out = {fix_text(c).lower() for c in creators}, []
    for item in raw:
        for kw in re.split(r"[,;]", fix_text(item).lower()):
            kw = re.sub(r"\s+", " ", kw.replace("_", " ")).strip(" .-'\"")
            if (re.search(r"[^\W\d_]", kw) and not NOISE.search(kw) and "@" not in kw and kw not in STOP
                    and kw not in names and kw not in out and (" " in kw or len(kw) <= 20)):
                out.append(kw)
    return out


def pick_keywords(keywords: list[str], name: str, freq: Counter) -> list[str]:
    """Keywords that add to the name and to each other, most frequent in the corpus first, at most MAX_KEYWORDS."""
    seen, kept = {fold(w) for w in words(name)}, []
    for kw in sorted(keywords, key=lambda k: -freq[k]):  # stable sort: ties stay in source order
        folded = {fold(w) for w in words(kw)}
        if folded and not folded <= seen:
            kept.append(kw)
            seen |= folded
    return kept[:MAX_KEYWORDS]


def make_caption(name: str, description: str, keywords: list[str]) -> str:
    """'Name. Description. kw1, kw2' with empty parts left out."""
    return ". ".join(p for p in (name, description, ", ".join(keywords)) if p)


def read_metadata(svg: Path) -> dict | None:
    """Title, description, keywords and creators of the first cc:Work, None without one; raises ET.ParseError."""
    local = lambda el: el.tag.rsplit("}", 1)[-1]  # noqa: E731 - namespace URIs vary between exporters
    with open(svg, "rb") as f:
        for _, el in ET.iterparse(f):  # stops at the end of the metadata, not of the drawing
            if local(el) == "Work":
                meta = {"title": "", "description": "", "keywords": [], "creators": []}
                for child in el:
                    kind = local(child)
                    if kind in ("title", "description"):
                        meta[kind] = "".join(child.itertext())
                    elif kind == "subject":
                        meta["keywords"] = ["".join(li.itertext()) for li in child.iter() if local(li) == "li"]
                    elif kind == "creator":
                        meta["creators"] = ["".join(t.itertext()) for t in child.iter() if local(t) == "title"]
                return meta
    return None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--svg-root", type=Path, default=Path("/usr/share/openclipart/svg"))
    ap.add_argument("--png-root", type=Path, default=Path("/usr/share/openclipart/png"))
    ap.add_argument("--out", type=Path, required=True, help="Parquet table to write")
    ap.add_argument("--limit", type=int, default=None, help="keep N evenly spaced files of the sorted list")
    args = ap.parse_args()
    t0 = time.time()

    svgs, metas = sorted(args.svg_root.rglob("*.svg")), {}
    for svg in track(svgs, description="reading SVG metadata", console=Console(stderr=True)):
        try:
            metas[svg] = read_metadata(svg)
        except (ET.ParseError, LookupError):  # LookupError: unknown encoding in the XML declaration
            metas[svg] = "malformed_xml"
    good = [m for m in metas.values() if isinstance(m, dict)]
    titles = Counter(fix_text(m["title"]) for m in good)
    descriptions = Counter(fix_text(m["description"]) for m in good)
    freq = Counter(kw for m in good for kw in split_keywords(m["keywords"], m["creators"]))

    chosen = svgs if not args.limit or args.limit >= len(svgs) else \
        [svgs[i * len(svgs) // args.limit] for i in range(args.limit)]
    rows, skipped = {k: [] for k in ("image", "caption", "uid", "title", "keywords", "category", "description")}, \
        Counter()
    for svg in chosen:
        rel, meta = svg.relative_to(args.svg_root), metas[svg]
        uid = rel.with_suffix("").as_posix()
        png = args.png_root / f"{uid}.png"  # not with_suffix: names may hold dots ("button.rss")
        reason = "no_png" if not png.is_file() else meta if isinstance(meta, str) else None if meta else "no_metadata"
        if reason is None:
            name = pick_name(meta["title"], rel.stem, meta["creators"], titles[fix_text(meta["title"])])
            desc = clean_description(meta["description"], name, descriptions[fix_text(meta["description"])])
            keywords = pick_keywords(split_keywords(meta["keywords"], meta["creators"]), name, freq)
            caption = make_caption(name, desc, keywords)
            reason = None if caption else "empty_caption"
        if reason:
            skipped[reason] += 1
            continue
        for k, v in zip(rows, (str(png.resolve()), caption, uid, name, keywords, rel.parts[0], desc), strict=True):
            rows[k].append(v)

    args.out.parent.mkdir(parents=True, exist_ok=True)
    schema = pa.schema([("image", pa.string()), ("caption", pa.string()), ("uid", pa.string()),
                        ("title", pa.string()), ("keywords", pa.list_(pa.string())), ("category", pa.string()),
                        ("description", pa.string())])
    pq.write_table(pa.table(rows, schema=schema), args.out)
    n = len(rows["caption"])
    print(f"{n} rows ({len(set(rows['caption']))} distinct captions) written to {args.out} from {len(chosen)} SVGs "
          f"in {time.time() - t0:.1f}s; skipped: " + ", ".join(f"{r} {skipped[r]}" for r in REASONS))
    for i in range(0, n, max(1, n // 5))[:5]:
        print(f"  {rows['uid'][i]}: {rows['caption'][i]}")


if __name__ == "__main__":
    main()
