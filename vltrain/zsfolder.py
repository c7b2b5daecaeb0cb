"""The image-folder zero-shot benchmark as files: ROOT/CLASS/*.jpg found and numbered as torchvision's ImageFolder
numbers them, ROOT/classnames.txt and ROOT/templates.txt read and checked, each file read with a size bound. No model
code: the run config checks a benchmark with these before training (vltrain.config), and vltrain.zeroshot scores it.
"""

import os
import warnings
from pathlib import Path

import torch
from PIL import Image

from vlprep import cut
from vlprep.sources import IMAGE_SUFFIXES
from vlprep.userfile import FileTooLarge, NotARegularFile, read_regular
from vltrain.errors import TrainError


# CLIP's 7-template ImageNet ensemble, chosen by the CLIP authors from their 80 ImageNet templates by forward
# selection on ImageNet (their "Prompt Engineering for ImageNet" notebook); open_clip ships it as
# SIMPLE_IMAGENET_TEMPLATES. Used when neither --templates nor ROOT/templates.txt is given.
DEFAULT_TEMPLATES = ("itap of a {}.", "a bad photo of the {}.", "a origami {}.", "a photo of the large {}.",
                     "a {} in a video game.", "art of the {}.", "a photo of the small {}.")
IMAGE_BYTES = 1 << 28  # 256 MiB: far above any photo; a FIFO or /dev/zero must not be read without bound
TEXT_BYTES = 1 << 20  # templates.txt and classnames.txt: ImageNet-21k's 21,841 names take about 400 KB


def read_text(path, what: str) -> str:
    """A small text file the user names (templates, class names): a regular file of at most TEXT_BYTES of UTF-8 (a
    BOM is allowed). A FIFO would block the read and /dev/zero never end it: each is a one-line TrainError."""
    path = Path(path)
    try:
        data = read_regular(path, TEXT_BYTES)
    except NotARegularFile:
        raise TrainError(f"{what} {path} is not a regular file (a folder, FIFO or device); give a text file") from None
    except FileTooLarge:
        raise TrainError(f"{what} {path}: more than {TEXT_BYTES:,} bytes; a {what} file is a short text file") from None
    except OSError as e:
        raise TrainError(f"cannot read {what} {path}: {e.strerror or type(e).__name__}") from None
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError:
        raise TrainError(f"{what} {path}: not UTF-8 text") from None


def read_image(path) -> Image.Image:
    """An image file as RGB; a missing, non-regular (FIFO, device), oversized or undecodable file, or a decompression
    bomb, is a one-line ValueError."""
    from vlprep.dataset import decode_rgb

    try:
        try:
            data = read_regular(path, IMAGE_BYTES)
        except NotARegularFile:
            raise ValueError(f"image {path} is not a regular file") from None
        except FileTooLarge as e:
            raise ValueError(f"image {path}: {e.size:,} bytes, more than {IMAGE_BYTES:,}") from None
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            return decode_rgb(data)
    except Image.DecompressionBombError as e:
        raise ValueError(f"image {path}: refused as a decompression bomb ({e})") from None
    except Image.UnidentifiedImageError:
        raise ValueError(f"cannot read image {path}: not an image format Pillow decodes") from None
    except (OSError, SyntaxError) as e:
        raise ValueError(f"cannot read image {path}: {e.strerror or e if isinstance(e, OSError) else e}") from None


def check_templates(templates, where: str) -> None:
    """A list of templates, each a string with `{}` where the class name goes, as `--templates` requires; a single
    string (which would be read character by character), an empty list or a template without `{}` is a one-line
    ValueError starting with `where`."""
    if not isinstance(templates, (list, tuple)):
        raise ValueError(f"{where}: expected a list of templates, each with {{}} for the class name, not a "
                         f"{type(templates).__name__}")
    if not templates:
        raise ValueError(f"{where}: no templates (one per line, each with {{}} where the class name goes)")
    for t in templates:
        if not isinstance(t, str):
            raise ValueError(f"{where}: a template is a {type(t).__name__}, not a string")
        if "{}" not in t:
            raise ValueError(f"{where}: template {cut(repr(t))} has no {{}} for the class name")
        try:
            t.encode("utf-8")
        except UnicodeEncodeError:
            raise ValueError(f"{where}: template {cut(ascii(t))} is not valid Unicode") from None


def read_templates(path) -> list[str]:
    """One template per line, each holding `{}` where the class name goes; blank lines are ignored."""
    path = Path(path)
    templates = [t for t in (line.strip() for line in read_text(path, "templates").splitlines()) if t]
    try:
        check_templates(templates, str(path))
    except ValueError as e:
        raise TrainError(str(e)) from None
    return templates


def fill(template: str, name: str) -> str:
    """The prompt for one class: every `{}` replaced by the name (str.format would choke on other braces)."""
    return template.replace("{}", name)


# --- the image-folder benchmark --------------------------------------------------------------------------------


def _classnames(path: Path, folders: list[str]) -> list[str]:
    """Readable names from classnames.txt: `FOLDER<TAB>name` lines (a folder left out keeps its name, "_" read as a
    space), or one name per line in sorted folder order."""
    lines = [line.rstrip("\r") for line in read_text(path, "class names").splitlines() if line.strip()]
    tabbed = sum("\t" in line for line in lines)
    if 0 < tabbed < len(lines):
        plain = next(line for line in lines if "\t" not in line)
        raise TrainError(f"{path} mixes FOLDER<TAB>name lines with plain name lines (e.g. {cut(repr(plain))}); use "
                         "one form for the whole file")
    if lines and tabbed:
        pairs = [line.split("\t", 1) for line in lines]
        names = dict(pairs)
        if len(names) < len(pairs):
            again = next(f for i, (f, _) in enumerate(pairs) if f in dict(pairs[:i]))
            raise TrainError(f"{path}: folder {cut(repr(again))} is named twice")
        unknown = [f for f in names if f not in folders]
        if unknown:
            raise TrainError(f"{path}: {cut(repr(unknown[0]))} is not a class folder of {path.parent}")
        found = [names[f].strip() if names.get(f, "").strip() else f.replace("_", " ") for f in folders]
    elif len(lines) != len(folders):
        raise TrainError(f"{path}: {len(lines)} names for {len(folders)} class folders; give one name per folder, in "
                         "sorted folder order, or FOLDER<TAB>name lines")
    else:
        found = [line.strip() for line in lines]
    twice = next((n for i, n in enumerate(found) if n in found[:i]), None)
    if twice is not None:
        raise TrainError(f"{path}: class name {cut(repr(twice))} is given to two folders; two classes of one name tie "
                         "and always lose: give each folder its own name")
    return found


def image_folder(root) -> dict:
    """The benchmark at ROOT: {'files', 'labels', 'folders', 'names', 'templates' (None: not given)}.

    Classes are the sub-folders holding at least one image (file suffix .jpg, .png, ...), sorted by name, as
    torchvision's ImageFolder numbers them; images are found at any depth below the class folder."""
    root = Path(root)
    if not root.is_dir():
        raise TrainError(f"zero-shot folder not found: {root}")
    files = []
    labels = []
    folders = []
    unreadable = []
    for folder in sorted(p for p in root.iterdir() if p.is_dir()):
        images = sorted(p for p in _walk(folder, root, unreadable)
                        if p.suffix.lower() in IMAGE_SUFFIXES and p.is_file())
        if images:
            files.extend(images)
            labels.extend([len(folders)] * len(images))
            folders.append(folder.name)
    if len(folders) < 2:
        raise TrainError(f"{root}: a zero-shot benchmark needs at least 2 class folders holding images "
                         f"(ROOT/CLASS/*.jpg), found {len(folders)}"
                         + (f"; {len(unreadable)} folder(s) could not be read: {unreadable[0]}" if unreadable else ""))
    names_file = root / "classnames.txt"
    templates_file = root / "templates.txt"
    # present in any form (a FIFO, a link to a device) they are read, and read_text refuses what is not a small file
    given = [p.exists() or p.is_symlink() for p in (names_file, templates_file)]
    names = _classnames(names_file, folders) if given[0] else [f.replace("_", " ") for f in folders]
    templates = read_templates(templates_file) if given[1] else None
    return {"files": files, "labels": torch.tensor(labels), "folders": folders, "names": names,
            "templates": templates, "unreadable": unreadable}


def _walk(folder: Path, root: Path, unreadable: list) -> list[Path]:
    """Every file below `folder`, at any depth (symlinked folders are not entered, as Path.rglob does); a folder that
    cannot be listed is appended to `unreadable` as 'PATH (reason)', relative to `root`, instead of vanishing."""
    def failed(e: OSError) -> None:
        where = Path(e.filename).relative_to(root) if e.filename else folder.name
        unreadable.append(f"{where} ({e.strerror or type(e).__name__})")

    return [Path(top, name) for top, _, names in os.walk(folder, onerror=failed) for name in names]
