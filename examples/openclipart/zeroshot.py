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

--folder ROOT writes the same selection as an image-folder benchmark instead of (or besides) the table, for
`vltrain eval --zeroshot-folder ROOT`: ROOT/FOLDER/NAME.png symlinks to the PNGs (FOLDER the category folder,
NAME the uid with "/" -> "__", unique because uids are) and ROOT/classnames.txt with `FOLDER<TAB>class name`
lines, the CLASSES mapping. No templates.txt: `vltrain eval` then uses its built-in prompt ensemble. ROOT is
replaced only when its contents change, and only if it is such a folder already (it has a classnames.txt).
--exclude also takes Karpathy-split JSON files (make_karpathy.py): their images are --image-root/filepath/filename.

The recipes' bigger set (pipelines/inputs.yaml: heldout-zeroshot-table) is built from every image in no training
table, with --more-classes --per-class 200, and excludes the recipes' retrieval set (heldout-retrieval, a Karpathy
file); excluding by file also excludes by uid, as a uid names one file. Choices, on the demo's numbers:
- Retrieval chooses first, zero-shot takes the rest. Retrieval can use only images with a full caption no other
  held-out image has and at least two texts (2,131 of the 4,510 held-out files), zero-shot any image of a class
  folder, the ones sharing a caption ("Smiley. people" x31) too; zero-shot first would take nearly every held-out
  animal, food, person, ... picture and leave retrieval mostly computer icons and flags.
- --more-classes adds two folders that hold one kind of thing a caption names: office -> "office supply" (pens,
  folders, pins, paper clips, phones, floppy disks) and electronics -> "electronic device" (CDs, cameras, batteries,
  light bulbs). Left out: containers (16 files in all, ~5 left after training and retrieval), education (books,
  paper, scissors, staplers: office's pictures under another folder, so the folder label would often be wrong),
  science (planets, pills, flasks), decorations (flourishes, knots), shapes (84% one series of 1,378 stars with one
  caption) and the mixed bags above.
- --per-class 200 keeps every eligible image of each class up to 200 (evenly spaced in uid order beyond): the
  classes hold 17 (electronic device) to 149 (person) eligible images, but computer icon 745 and symbol 385, which
  uncapped would be 63% of the 1,805 images, and top-1 over images would mostly measure those two. Capped at about
  the largest other class they are 37% of 1,075, at the cost of sampling sd (1.5 points at 35% top-1, 1.1 uncapped).
"""

import argparse
import json
import os
import shutil
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

# folder -> class name, as a caption or a prompt ("a photo of a {}") would say it
CLASSES = {"animals": "animal", "food": "food", "people": "person", "transportation": "vehicle", "plants": "plant",
           "buildings": "building", "tools": "tool", "geography": "map", "computer": "computer icon",
           "signs_and_symbols": "symbol"}
# --more-classes (the recipes' bigger set): two more folders that hold one kind of thing each
MORE_CLASSES = {"office": "office supply", "electronics": "electronic device"}


def evenly(rows: list, n: int) -> list:
    return rows if n >= len(rows) else [rows[i * len(rows) // n] for i in range(n)]


def excluded_images(path: Path, image_root: Path) -> list[str]:
    """Resolved image paths of a table (its `image` column) or of a Karpathy-split JSON file (root/filepath/name)."""
    if path.suffix == ".json":
        images = json.loads(path.read_text(encoding="utf-8"))["images"]
        return [str((image_root / im.get("filepath", "") / im["filename"]).resolve()) for im in images]
    return pq.read_table(path, columns=["image"]).column(0).to_pylist()


def folder_listing(root: Path) -> tuple[str, dict[str, str]] | None:
    """(classnames.txt, {FOLDER/NAME: symlink target}) of an image folder written by write_folder, None if absent."""
    if not (root / "classnames.txt").is_file():
        return None
    links = {p.relative_to(root).as_posix(): os.readlink(p) for p in root.glob("*/*") if p.is_symlink()}
    return (root / "classnames.txt").read_text(encoding="utf-8"), links


def write_folder(root: Path, picked: dict[str, list[tuple[str, str]]], classes: dict[str, str] = CLASSES) -> bool:
    """ROOT/FOLDER/NAME.png -> image and ROOT/classnames.txt; False when ROOT already holds exactly that."""
    picked = {folder: rows for folder, rows in picked.items() if rows}  # a class without images cannot be scored
    classnames = "".join(f"{folder}\t{classes[folder]}\n" for folder in picked)
    links = {f"{folder}/{uid.replace('/', '__')}.png": image for folder, rows in picked.items() for image, uid in rows}
    if len(links) != sum(map(len, picked.values())):
        raise SystemExit("two uids map to the same file name in the zero-shot folder")
    old = folder_listing(root)
    if old == (classnames, links):
        return False
    if old is None and root.exists() and (not root.is_dir() or any(root.iterdir())):
        raise SystemExit(f"{root} exists and is not a zero-shot folder (no classnames.txt): not replacing it")
    tmp = root.with_name(root.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)  # a cut run's leftover; rmtree removes symlinks, not their targets
    for folder in picked:
        (tmp / folder).mkdir(parents=True)
    for name, image in links.items():
        (tmp / name).symlink_to(image)
    (tmp / "classnames.txt").write_text(classnames, encoding="utf-8")
    if root.exists():
        shutil.rmtree(root)
    tmp.rename(root)
    return True


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--all", type=Path, required=True, help="captions of every file (make_captions.py, no --limit)")
    ap.add_argument("--exclude", type=Path, nargs="+", required=True,
                    help="tables (or Karpathy JSON files) whose images must not be in the set (aligned, unaligned, "
                         "eval)")
    ap.add_argument("--per-class", type=int, default=30,
                    help="images per class (default 30), or all of a class's eligible images when it has fewer")
    ap.add_argument("--more-classes", action="store_true",
                    help="add the office and electronics folders as classes (MORE_CLASSES; the recipes' set)")
    ap.add_argument("--out", type=Path, help="the zero-shot table (Parquet: image, caption, uid)")
    ap.add_argument("--classes", type=Path, help="classes.txt to write (with --out), one class name per line")
    ap.add_argument("--folder", type=Path, help="image folder to write: FOLDER/NAME.png symlinks and classnames.txt")
    ap.add_argument("--image-root", type=Path, default=Path("/usr/share/openclipart/png"),
                    help="root of the Karpathy JSON files' filepath entries (default /usr/share/openclipart/png)")
    args = ap.parse_args()
    if (args.out is None) != (args.classes is None) or (args.out is None and args.folder is None):
        ap.error("give --out and --classes (the table), --folder (the image folder), or both")

    classes = {**CLASSES, **MORE_CLASSES} if args.more_classes else CLASSES
    table = pq.read_table(args.all, columns=["image", "uid", "category"]).to_pydict()
    used = set()
    for path in args.exclude:
        used.update(excluded_images(path, args.image_root))
    rows, seen = {c: [] for c in classes}, set()
    for image, uid, category in sorted(zip(table["image"], table["uid"], table["category"]), key=lambda r: r[1]):
        if category in classes and image not in used and image not in seen:
            seen.add(image)
            rows[category].append((image, uid))
    picked = {category: evenly(rows[category], args.per_class) for category in classes}
    counts = ", ".join(f"{classes[c]} {len(v)}" for c, v in picked.items())
    total = sum(map(len, picked.values()))
    if args.out is not None:
        out = {"image": [], "caption": [], "uid": []}
        for category, name in classes.items():
            for image, uid in picked[category]:
                out["image"].append(image)
                out["caption"].append(name)
                out["uid"].append(uid)
        tmp = args.out.with_name(args.out.name + ".tmp")
        pq.write_table(pa.table(out), tmp)
        tmp.replace(args.out)
        args.classes.write_text("".join(name + "\n" for name in classes.values()))
        print(f"zero-shot set: {total} images in {len(classes)} classes -> {args.out} ({counts}); "
              f"classes -> {args.classes}")
    if args.folder is not None:
        changed = write_folder(args.folder, picked, classes)
        print(f"zero-shot folder: {total} images in {len(classes)} classes -> {args.folder} ({counts})"
              + ("" if changed else "; unchanged"))


if __name__ == "__main__":
    main()
