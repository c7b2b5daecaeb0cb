"""A labelled zero-shot set from openclipart's own folders, disjoint from every image the demo trains or scores on.

Debian files each clip under a top-level category folder (`animals/`, `food/`, `transportation/`, ...;
make_captions.py keeps it as the `category` column). Ten of the 22 folders name a kind of picture that a caption
can name too; each becomes a class with a plain-English name ("transportation" -> "vehicle"). The other folders
(`shapes`, `special`, `unsorted`, `recreation`, ...) are mixed bags and are left out.

An image is eligible when its PNG file is in none of the --exclude tables (the aligned training subset, the
unaligned images that get pseudo-captions, the retrieval eval set); the comparison is by file, not by uid,
because Debian ships some files under two folders. From each class, --per-class evenly spaced eligible files (sorted
by uid) are kept, so the set is balanced and deterministic. The caption of each row is its class name, so that
`vltrain eval --zeroshot classes.txt` labels it (a sample's label is the class named in its caption); the
retrieval figures `vltrain eval` also prints on this set mean nothing (many rows share a caption).
"""

import argparse
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

# folder -> class name, as a caption or a prompt ("a photo of a {}") would say it
CLASSES = {"animals": "animal", "food": "food", "people": "person", "transportation": "vehicle", "plants": "plant",
           "buildings": "building", "tools": "tool", "geography": "map", "computer": "computer icon",
           "signs_and_symbols": "symbol"}


def evenly(rows: list, n: int) -> list:
    return rows if n >= len(rows) else [rows[i * len(rows) // n] for i in range(n)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--all", type=Path, required=True, help="captions of every file (make_captions.py, no --limit)")
    ap.add_argument("--exclude", type=Path, nargs="+", required=True,
                    help="tables whose images must not be in the set (aligned, unaligned, eval)")
    ap.add_argument("--per-class", type=int, default=30, help="images per class (default 30)")
    ap.add_argument("--out", type=Path, required=True, help="the zero-shot table (Parquet: image, caption, uid)")
    ap.add_argument("--classes", type=Path, required=True, help="classes.txt to write, one class name per line")
    args = ap.parse_args()

    table = pq.read_table(args.all, columns=["image", "uid", "category"]).to_pydict()
    used = set()
    for path in args.exclude:
        used.update(pq.read_table(path, columns=["image"]).column(0).to_pylist())
    rows, seen = {c: [] for c in CLASSES}, set()
    for image, uid, category in sorted(zip(table["image"], table["uid"], table["category"]), key=lambda r: r[1]):
        if category in CLASSES and image not in used and image not in seen:
            seen.add(image)
            rows[category].append((image, uid))
    out = {"image": [], "caption": [], "uid": []}
    counts = {}
    for category, name in CLASSES.items():
        picked = evenly(rows[category], args.per_class)
        counts[name] = len(picked)
        for image, uid in picked:
            out["image"].append(image)
            out["caption"].append(name)
            out["uid"].append(uid)
    tmp = args.out.with_name(args.out.name + ".tmp")
    pq.write_table(pa.table(out), tmp)
    tmp.replace(args.out)
    args.classes.write_text("".join(name + "\n" for name in CLASSES.values()))
    print(f"zero-shot set: {len(out['uid'])} images in {len(CLASSES)} classes -> {args.out} "
          f"({', '.join(f'{k} {v}' for k, v in counts.items())}); classes -> {args.classes}")


if __name__ == "__main__":
    main()
