"""Held-out openclipart tables for the pseudolabel demo: images outside the aligned subset, as unaligned and eval sets.

Reads the captions of all files (make_captions.py without --limit) and the aligned table (with --limit), and keeps
the rows whose uid and image file the aligned table (and every --exclude table) lacks, in uid order. The eval set
takes --eval evenly spaced rows among those with a caption and an image file no other held-out row has (a caption
shared by many files, like the 1,375 "Star. geometry, shapes", has no single right image, so retrieval on it is a
coin toss); the unaligned set takes --unaligned evenly spaced rows of the rest whose image file is not in the eval
set. Both are deterministic. The unaligned captions stay in the table, because `vlprep shards` wants one, but
`vlprep pseudolabel` ignores them (its grid shows them in grey for comparison).

The recipes' bigger held-out retrieval set (pipelines/inputs.yaml, heldout-retrieval) calls it with --exclude
(the unaligned table too: its rows are trained on by some recipes, so they are not held out), no unaligned set, and
--eval all: every held-out row with a distinct caption, from which make_karpathy.py --size picks its images.
"""

import argparse
import sys
from collections import Counter
from pathlib import Path

import pyarrow.parquet as pq


def evenly(rows: list, n: int) -> list:
    return rows if n >= len(rows) else [rows[i * len(rows) // n] for i in range(n)]


def count(text: str) -> int:
    """A row count, or "all" (every candidate)."""
    return sys.maxsize if text == "all" else int(text)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--all", type=Path, required=True, help="captions of every file (make_captions.py, no --limit)")
    ap.add_argument("--aligned", type=Path, required=True, help="the aligned captions table (make_captions.py)")
    ap.add_argument("--exclude", type=Path, nargs="+", default=[],
                    help="more tables whose rows are not held out either, by uid and by file (the unaligned table)")
    ap.add_argument("--unaligned", type=count, default=0, help="rows in the unaligned set (with --out-unaligned)")
    ap.add_argument("--eval", type=count, required=True, help="rows in the eval set, or all")
    ap.add_argument("--out-unaligned", type=Path)
    ap.add_argument("--out-eval", type=Path, required=True)
    args = ap.parse_args()
    if args.unaligned and args.out_unaligned is None:
        ap.error("--unaligned N needs --out-unaligned")

    table = pq.read_table(args.all)
    # By file, not only by uid: Debian ships some PNGs under two folders (two uids, one image), and such a copy of
    # a training image would leak it into the held-out sets.
    aligned_uids, aligned_images = set(), set()
    for path in (args.aligned, *args.exclude):
        aligned = pq.read_table(path, columns=["uid", "image"]).to_pydict()
        aligned_uids.update(aligned["uid"])
        aligned_images.update(aligned["image"])
    images = table.column("image").to_pylist()
    rows = sorted((uid, i) for i, uid in enumerate(table.column("uid").to_pylist())
                  if uid not in aligned_uids and images[i] not in aligned_images)
    captions = table.column("caption").to_pylist()
    shared, copies = Counter(captions[i] for _, i in rows), Counter(images[i] for _, i in rows)
    eval_rows = evenly([r for r in rows if shared[captions[r[1]]] == 1 and copies[images[r[1]]] == 1], args.eval)
    taken, eval_images = set(eval_rows), {images[i] for _, i in eval_rows}
    unaligned_rows = evenly([r for r in rows if r not in taken and images[r[1]] not in eval_images], args.unaligned)
    for rows_, path in ((unaligned_rows, args.out_unaligned), (eval_rows, args.out_eval)):
        if path is None:
            continue
        tmp = path.with_name(path.name + ".tmp")
        pq.write_table(table.take([i for _, i in rows_]), tmp)
        tmp.replace(path)
    print(f"held out {len(rows):,} files: "
          + (f"{len(unaligned_rows):,} unaligned -> {args.out_unaligned}, " if args.out_unaligned else "")
          + f"{len(eval_rows):,} eval (distinct captions) -> {args.out_eval}")


if __name__ == "__main__":
    main()
