"""A multi-caption retrieval set in Karpathy's split format from the demo's held-out eval images.

COCO and Flickr30k score retrieval with several captions per image (5 each, `dataset_coco.json`,
`dataset_flickr30k.json`): image→text is a hit when any of the image's captions ranks in the top K. openclipart has
no second caption, but its metadata holds up to three independent texts of each picture, written for different
purposes: the name (<dc:title>), the description (<dc:description>) and the keywords (<dc:subject>). make_captions.py
keeps them cleaned in its `title`, `description` and `keywords` columns; each becomes a caption here:
name, description (when non-empty and not the name again) and the keywords joined with ", " (when any), in that
order, duplicates (the same lowercase words) left out.

The images are those of the demo's eval table (--eval, heldout.py's eval.parquet): they are in no training
table (neither the aligned subset nor the unaligned images), by uid and by file, and their full captions are distinct.
Images with fewer than --min-captions captions (default 2) are left out: an image with only a name is already scored,
with that same text, by the single-caption eval table, and the point of this set is several captions per image.
The count of images with 1, 2 and 3 captions is printed either way. --size N then keeps N evenly spaced images (in
uid order) of those left, so a table of every held-out candidate yields a set of a chosen size (the recipes' bigger
held-out set, pipelines/inputs.yaml: heldout.py --eval all, then --size); without it every image is kept.

Single texts are less distinctive than full captions: a keyword list like "computer, icons" belongs to dozens of
eval images. Equal texts get equal scores, and `vltrain eval` ranks ties against the right answer, so a text that n
images share is an image→text hit only at K > n - 1, and a text→image query on it has n equally fitting images of
which one counts. Those texts stay by default (the protocol has no rule against them, they are true of their images,
and every image of the demo's set keeps at least one text of its own; the count is printed); --drop-shared drops
every caption whose text another eval image also has, heldout.py's rule for full captions applied to each text.

Format: {"images": [{"filepath", "filename", "split": "test", "imgid", "sentids", "sentences": [{"raw", "tokens",
"imgid", "sentid"}]}], "dataset": "openclipart"}, images in uid order, imgid = position, sentids numbered across
the file, tokens = the caption's lowercase words (letters, digits, inner apostrophes). filepath is the PNG's folder
relative to --image-root (the `image` column is the resolved path, so a drawing Debian ships under two folders
points at one file), filename its name: `vlprep shards FILE --image-root ROOT --split test` reads
image_root/filepath/filename. The file is rewritten only when its contents change.
"""

import argparse
import json
import re
from collections import Counter
from pathlib import Path

import pyarrow.parquet as pq


def tokens(text: str) -> list[str]:
    """Karpathy-style tokens: the text's lowercase words, punctuation dropped ('Blue Man#207' -> blue, man, 207)."""
    return re.findall(r"[^\W_]+(?:['’][^\W_]+)*", text.lower())  # "daughter's" stays one word


def captions_of(title: str, description: str, keywords: list[str]) -> list[str]:
    """Name, description, keywords joined with ', ': the non-empty ones, each once (compared as lowercase words)."""
    out, seen = [], set()
    for text in (title or "", description or "", ", ".join(keywords or [])):
        key = tuple(tokens(text))
        if key and key not in seen:
            seen.add(key)
            out.append(text.strip())
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--eval", type=Path, required=True,
                    help="the held-out eval table (heldout.py's eval.parquet; make_captions.py columns)")
    ap.add_argument("--image-root", type=Path, default=Path("/usr/share/openclipart/png"),
                    help="folder the filepath entries are relative to (default /usr/share/openclipart/png)")
    ap.add_argument("--min-captions", type=int, default=2, help="leave out images with fewer captions (default 2)")
    ap.add_argument("--drop-shared", action="store_true",
                    help="drop captions whose text another image of the set also has (before --min-captions)")
    ap.add_argument("--size", type=int, help="keep this many evenly spaced images (uid order) of those left "
                                             "(default: all)")
    ap.add_argument("--out", type=Path, required=True, help="the Karpathy-format JSON file to write")
    args = ap.parse_args()
    if args.size is not None and args.size < 1:
        ap.error("--size must be at least 1")

    table = pq.read_table(args.eval)
    if "description" not in table.column_names:
        ap.error(f"{args.eval} has no description column: rebuild it with this make_captions.py and heldout.py")
    rows = sorted(table.select(["uid", "image", "title", "description", "keywords"]).to_pylist(),
                  key=lambda r: r["uid"])
    caps = {r["uid"]: captions_of(r["title"], r["description"], r["keywords"]) for r in rows}
    texts = Counter(tuple(tokens(c)) for cs in caps.values() for c in cs)
    if args.drop_shared:
        caps = {uid: [c for c in cs if texts[tuple(tokens(c))] == 1] for uid, cs in caps.items()}
    by_count = Counter(len(cs) for cs in caps.values())

    root, least = args.image_root.resolve(), max(1, args.min_captions)
    kept_rows = [r for r in rows if len(caps[r["uid"]]) >= least]
    if args.size is not None and args.size < len(kept_rows):
        kept_rows = [kept_rows[i * len(kept_rows) // args.size] for i in range(args.size)]
    images, sentid = [], 0
    for r in kept_rows:
        png = Path(r["image"])
        if not png.is_file():
            raise SystemExit(f"{r['uid']}: image {png} not found")
        try:
            rel = png.relative_to(root)
        except ValueError:
            raise SystemExit(f"{r['uid']}: image {png} is not under --image-root {root}") from None
        imgid = len(images)
        sentences = [{"raw": c, "tokens": tokens(c), "imgid": imgid, "sentid": sentid + i}
                     for i, c in enumerate(caps[r["uid"]])]
        images.append({"filepath": rel.parent.as_posix(), "filename": rel.name, "split": "test", "imgid": imgid,
                       "sentids": [s["sentid"] for s in sentences], "sentences": sentences})
        sentid += len(sentences)

    text = json.dumps({"images": images, "dataset": "openclipart"}, ensure_ascii=False) + "\n"
    args.out.parent.mkdir(parents=True, exist_ok=True)
    if not args.out.is_file() or args.out.read_text(encoding="utf-8") != text:
        tmp = args.out.with_name(args.out.name + ".tmp")
        tmp.write_text(text, encoding="utf-8")
        tmp.replace(args.out)
    kept = Counter(len(im["sentences"]) for im in images)
    print(f"{len(images)} images, {sentid} captions -> {args.out}; images by caption count: "
          + ", ".join(f"{k}: {kept[k]}" for k in sorted(kept)))
    short = sum(by_count[k] for k in range(least))
    print(f"  of the {len(rows)} eval images, {short} with fewer than {least} captions left out ("
          + ", ".join(f"{k}: {by_count[k]}" for k in sorted(by_count)) + ")"
          + (f"; {len(images)} evenly spaced of the other {len(rows) - short} kept (--size)" if args.size else ""))
    if args.drop_shared:
        shared = Counter({t: n for t, n in texts.items() if n > 1})
        what = "captions dropped (--drop-shared): their text is another eval image's too"
    else:
        written = Counter(tuple(s["tokens"]) for im in images for s in im["sentences"])
        shared = Counter({t: n for t, n in written.items() if n > 1})
        what = "captions share their text with another image of the set (--drop-shared drops them)"
    print(f"  {sum(shared.values())} {what}: {len(shared)} texts, e.g. "
          + ", ".join(f"{' '.join(t)!r} x{n}" for t, n in shared.most_common(3)))


if __name__ == "__main__":
    main()
