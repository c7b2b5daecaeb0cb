"""The page of `vlprep view`: per-sample records for the page's JSON, the lineage, and the one self-contained HTML
file (template, CSS and JS from vlprep/data/view; every text reaches the page as JSON and is shown as text)."""

import base64
import hashlib
import html
import json
import math
import re
from collections import Counter
from pathlib import Path

from vlprep import cut, urls
from vlprep.dataset import MAX_JSON_DEPTH, _depth
from vlprep.text import tokenize

ASSETS = Path(__file__).parent / "data" / "view"
SLOT = re.compile(r"/\*@(TITLE|CSS|JS|DATA|HASH)@\*/")
JSON_FIELDS = ("caption_raw", "captions_raw", "bow", "objects", "nouns", "nodes", "pseudo", "strategy", "neighbours",
               "clip_score", "uid", "source", "width", "height")


def finite(value):
    """`value` with every NaN or infinity replaced by None: JSON.parse refuses them."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {str(k): finite(v) for k, v in value.items()}
    if isinstance(value, list):
        return [finite(v) for v in value]
    return value


def bow_words(raw: str, deformed: str) -> list[list]:
    """The original caption's tokens as [token, kept]: kept when the deformed caption still holds it (as a
    multiset, since the deformation may shuffle), so the page can strike out the removed ones."""
    left = Counter(tokenize(deformed))
    out = []
    for tok in tokenize(raw):
        kept = left[tok] > 0
        left[tok] -= kept
        out.append([tok, kept])
    return out


def load_json(data: bytes) -> dict | None:
    """JSON bytes as a dict; None when they are not JSON, not an object, or nested deeper than MAX_JSON_DEPTH (the page
    walks values recursively, and 100,000 levels are a RecursionError in json itself)."""
    try:
        value = json.loads(data)
    except (ValueError, RecursionError):  # UnicodeDecodeError is a ValueError
        return None
    if not isinstance(value, dict):
        return None
    # bytes.count runs in C: only a value with many brackets is walked
    if data.count(b"[") + data.count(b"{") > MAX_JSON_DEPTH and _depth(value) > MAX_JSON_DEPTH:
        return None
    return value


def shown(value) -> str:
    """A location a dataset's meta.json names, as the page and the terminal show it (never open it): redacted, cut,
    its control characters as `?`."""
    text = cut(urls.redact(str(value)), 200)
    return "".join(c if c.isprintable() else "?" for c in text)


def sample_record(raw: dict, shard: str, index: int, thumb: dict | None, onto: dict) -> dict:
    """What the page shows of one raw sample: key, thumbnail, captions and the fields the stages added; `onto` is an
    ontology stage's ontology.json (each noun's class and PMI), else {}."""
    meta = load_json(raw["json"]) if "json" in raw else {}
    bad = meta is None
    meta = meta or {}
    txt = raw.get("txt", b"").decode("utf-8", "replace")
    captions = meta.get("captions") if isinstance(meta.get("captions"), list) else [txt]
    rec = {"key": raw["__key__"], "shard": shard, "index": index, "thumb": thumb,
           "captions": [str(c) for c in captions]}
    rec.update({f: meta[f] for f in JSON_FIELDS if f in meta})
    if isinstance(meta.get("caption_raw"), str):
        rec["bow_words"] = bow_words(meta["caption_raw"], rec["captions"][0] if rec["captions"] else "")
    if isinstance(meta.get("nouns"), list):
        noun_class = onto.get("noun_to_class") or {}
        noun_pmi = onto.get("noun_pmi") or {}  # absent in ontologies written before it was recorded
        rec["noun_classes"] = {str(n[0]): noun_class[n[0]] for n in meta["nouns"]
                               if isinstance(n, list) and n and isinstance(n[0], str) and n[0] in noun_class}
        rec["noun_pmi"] = {n: noun_pmi[n] for n in rec["noun_classes"] if isinstance(noun_pmi.get(n), (int, float))}
    rec["json"] = meta
    if bad:
        rec["bad_json"] = True  # counted in the terminal's report; the card shows what there is
    return finite(rec)


def lineage(location: str, meta: dict, upstream: tuple[str, dict] | None) -> list[dict]:
    """[{location, stage, options}, ...]: the dataset, then (with --input, `upstream`: its location and meta.json) the
    input's stage and options, then the input last named, as text: a location a meta.json names is never opened."""
    chain = [{"location": location, "stage": meta.get("stage", ""), "options": meta.get("options", {})}]
    named = meta.get("input")
    if upstream is not None:
        where, up = upstream
        chain.append({"location": where, "stage": up.get("stage", ""), "options": up.get("options", {})})
        named = up.get("input")
    if isinstance(named, str):
        chain.append({"location": shown(named), "stage": "", "options": {}})
    return chain


def script_json(value) -> str:
    """JSON for a <script type="application/json"> block: `<`, `>` and `&` escaped as \\u00XX, so no text in it can
    close the block (`</script>`) or open a comment; U+2028/2029 are escaped by ensure_ascii."""
    text = json.dumps(finite(value), ensure_ascii=True, allow_nan=False, separators=(",", ":"))
    return text.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")


def render_page(info: dict, records: list[dict]) -> str:
    """The whole index.html: the template with its CSS, JS, title and data put in, in one pass (so nothing inserted
    is searched for slots again)."""
    js = (ASSETS / "view.js").read_text(encoding="utf-8")
    # the page's Content-Security-Policy lets only this script run: no inline handler, no other script
    digest = base64.b64encode(hashlib.sha256(js.encode("utf-8")).digest()).decode()
    parts = {"TITLE": html.escape(f"vlprep view: {info['dataset']}"),
             "CSS": (ASSETS / "view.css").read_text(encoding="utf-8"),
             "JS": js, "HASH": f"sha256-{digest}",
             "DATA": script_json({"info": info, "samples": records})}
    return SLOT.sub(lambda m: parts[m.group(1)], (ASSETS / "page.html").read_text(encoding="utf-8"))
