"""The `vltrain export` folder's format: its files, config.json and weights, written and read."""

import contextlib
import copy
import ctypes
import errno
import glob
import hashlib
import json
import os
import secrets
import shutil
from pathlib import Path

import torch

from safetensors import SafetensorError
from safetensors.torch import load_file as load_safetensors
from safetensors.torch import save_file

from vlprep import cut
from vlprep.urls import redact
from vltrain import hfclip, openclip
from vltrain.errors import CheckpointError, TrainError, check_version

# An export holds model.safetensors (the weights inference reads: no optimiser state, RNG states, EMA copy
# or queues), config.json (format, the run's config, preprocessing, tokenizer, provenance, eval numbers),
# tokenizer/ (the Hugging Face tokenizer files), README.md and, with --onnx, image_encoder.onnx and
# text_encoder.onnx (and a features model's image_tokens_encoder.onnx). Everything is written into a folder beside
# OUT, config.json last, and that folder is swapped in when complete (swap_in): a failure or a kill never leaves a
# half export at OUT. A folder without config.json is an unfinished export, which read_export refuses.
CONFIG = "config.json"
WEIGHTS = "model.safetensors"
TOKENIZER = "tokenizer"
README = "README.md"
IMAGE_ONNX = "image_encoder.onnx"
TEXT_ONNX = "text_encoder.onnx"
IMAGE_TOKENS_ONNX = "image_tokens_encoder.onnx"  # a features model's image graph over its cached tokens
# `--format hf` / `open_clip` (vltrain.export_hf): the other library's config and weights, the tokenizer and image
# processor files at the top, the tensors the library does not hold in HEADS, and META, the export's own record (what
# config.json is in the vltrain layout), written last.
HEADS = "vltrain_heads.safetensors"
META = "vltrain.json"
HF_FILES = ("open_clip_config.json", "open_clip_model.safetensors", "tokenizer.json", "tokenizer_config.json",
            "special_tokens_map.json", "vocab.json", "merges.txt", "added_tokens.json", "preprocessor_config.json",
            "processor_config.json", "generation_config.json", "spiece.model")

# Every name an export writes (config.json's temporary file included): all that exporting again replaces.
EXPORT_FILES = (CONFIG, CONFIG + ".tmp", WEIGHTS, TOKENIZER, README, IMAGE_ONNX, TEXT_ONNX, IMAGE_TOKENS_ONNX, META,
                META + ".tmp", HEADS) + HF_FILES
# What `vltrain eval EXPORT` writes into an export by default: still an export, and its scores go with its weights,
# so exporting again over a previous export removes it (it scored the weights replaced).
EVAL = "eval.json"
RESIZE = "shorter side then centre crop"  # config.json's first word on it, kept for its readers
# torchvision v2's Resize of a uint8 image on the CPU, as eval_transform runs it on AVX2, AVX-512 and ARM CPUs (on other
# x86 CPUs torchvision resizes in float32 and rounds: a pixel may come out one level apart). PIL's bilinear resize is
# no substitute: its weights have 22 bits, these 15 at most, and for some sizes it takes the height first; either
# rounds some pixels one level apart.
RESIZE_KERNEL = ("separable: width, then height, each pass rounded to uint8. Along a side of m pixels resized to n, "
                 "with s = m / n, output pixel i weighs input pixel j by max(0, 1 - |j - s * (i + 0.5) + 0.5| / "
                 "max(s, 1)), normalised to sum 1 (summed in order of j); in fixed point each weight is "
                 "floor(w * 2^p + 0.5), with p the largest number of bits up to 22 for which that stays under 2^15 "
                 "for the largest weight of the side; the output is "
                 "(sum of pixel * weight + 2^(p - 1)) >> p, clipped to [0, 255]")

EXPORT_FORMAT = "vltrain-export"  # config.json's "format"
EXPORT_VERSION = 1  # config.json's "version"
CONFIG_JSON_BYTES = 16 << 20  # an export's config.json is a few KB
# What an export leaves out of the state dict: training state that inference never reads, the EMA copy (every key
# under `momentum.`) and the MoCo queues with their pointer. A model rebuilt from an export is built with
# EXPORT_MODEL's values, so it has none of these tensors (rather than random ones) and loading stays strict.
EXPORT_DROPS = ("momentum.", "image_queue", "text_queue", "queue_ptr")
EXPORT_MODEL = {"momentum": False, "queue_size": 0}


def is_export(path: Path) -> bool:
    """Whether a folder is, or claims to be, a `vltrain export` (perhaps unfinished or damaged, which read_export
    says): it holds model.safetensors or config.json. Other folders keep load's "a folder, not a checkpoint"."""
    return (path / CONFIG).is_file() or (path / WEIGHTS).is_file() or (path / META).is_file()


def untie(state: dict) -> tuple[dict, dict]:
    """(tensors, tied): every tensor once, as safetensors requires, contiguous; `tied` maps each further name of a
    shared tensor (the MLM decoder's weight is the word embeddings) to the name kept, for read_export to restore."""
    seen = {}
    tensors = {}
    tied = {}
    for name, t in state.items():  # the state dict's order: the first name of a shared tensor is the one kept
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), tuple(t.stride()), t.dtype)
        if t.numel() and key in seen:
            tied[name] = seen[key]
        else:
            seen[key] = name
            tensors[name] = t.detach().contiguous()
    return tensors, tied


def read_export(path, what: str = "export") -> dict:
    """A `vltrain export` folder as a checkpoint-shaped dict {"model", "config", "step", "data", "export": True},
    read with json and safetensors only: no unpickler, so nothing in the folder can run code. model_from rebuilds
    it (without EXPORT_DROPS). A missing, truncated or foreign config.json or model.safetensors is one line."""
    path = Path(path)
    hf = (path / META).is_file()  # --format hf / open_clip: vltrain.json is the export's record
    meta_path = path / (META if hf else CONFIG)
    weights_path = path / WEIGHTS
    if not meta_path.is_file():
        raise CheckpointError(f"{what} {path}: not a complete vltrain export (no config.json; an export writes it "
                              "last, so this one did not finish: export again)")
    try:
        if meta_path.stat().st_size > CONFIG_JSON_BYTES:
            raise CheckpointError(f"{meta_path}: {meta_path.stat().st_size:,} bytes; an export's config.json is a "
                                  f"few KB (at most {CONFIG_JSON_BYTES:,})")
        meta = json.loads(meta_path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        raise CheckpointError(f"{meta_path}: not readable JSON (truncated or corrupt: {type(e).__name__})") from None
    if not isinstance(meta, dict) or meta.get("format") != EXPORT_FORMAT:
        raise CheckpointError(f"{what} {path} is a folder, and its {meta_path.name} is not a vltrain export's (no "
                              f"\"format\": \"{EXPORT_FORMAT}\"); give a checkpoint file (last.pt, best.pt) or an "
                              "export")
    check_version(meta.get("version"), EXPORT_VERSION, "export version", meta_path, path)
    config = meta.get("config")
    source = meta.get("source") or {}
    tied = meta.get("tied") or {}
    if not isinstance(config, dict) or not isinstance(config.get("model"), dict):
        raise CheckpointError(f"{meta_path}: no \"config\" with a \"model\" section")
    for key, value in (("source", source), ("tied", tied)):
        if not isinstance(value, dict):
            raise CheckpointError(f"{meta_path}: \"{key}\" is a {type(value).__name__}, not a mapping")
    if hfclip.is_clip(config["model"].get("text_model")):  # the export's copy of a CLIP tower's tokenizer
        try:
            hfclip.check_tokenizer(path if hf else path / TOKENIZER)
        except ValueError as e:
            raise CheckpointError(f"{what} {path}: {e}") from None
    if meta.get("layout") == "open_clip":
        weights_path = path / openclip.WEIGHTS
    weights = _safetensors(weights_path)
    if hf:  # the other library's tensors under vltrain's names, then the heads (whose temp is the exact one)
        weights = hfclip.to_vltrain(openclip.to_hf(weights) if meta.get("layout") == "open_clip" else weights)
        weights = {**weights, **_safetensors(path / HEADS)}
    # safetensors stores a tensor once: a tied weight (the MLM decoder shares the word embeddings) is listed by name
    for alias, name in tied.items():
        if name not in weights:
            raise CheckpointError(f"{meta_path}: tied weight {alias!r} names {name!r}, which model.safetensors lacks")
        weights[alias] = weights[name]
    return {"model": weights, "config": config, "step": source.get("step"), "data": source.get("data"),
            "export": True, "tokenizer": str(path if hf else path / TOKENIZER)}


def _safetensors(path: Path) -> dict:
    """Every tensor of a safetensors file, on the CPU; one line when it is missing, truncated or corrupt."""
    if not path.is_file():
        raise CheckpointError(f"{path.parent}: the export has no {path.name}")
    try:
        return load_safetensors(path, device="cpu")
    except (SafetensorError, OSError) as e:
        why = str(e).splitlines()[0][:160] if str(e) else type(e).__name__
        raise CheckpointError(f"{path}: not a readable safetensors file (truncated or corrupt: {why})") from None


# --- writing ---------------------------------------------------------------------------------------------------


def previous_export(out: Path) -> bool:
    """Whether `out` holds nothing but an export's files (finished, or unfinished: no config.json yet), so that
    exporting again may replace them without --overwrite; a finished one may also hold the eval.json of `vltrain
    eval EXPORT`."""
    names = {p.name for p in out.iterdir()}
    if not names <= set(EXPORT_FILES) | {EVAL}:
        return False
    record = META if META in names else CONFIG
    if record not in names:
        return EVAL not in names  # an eval.json without an export's config.json is not ours to remove
    try:
        return json.loads((out / record).read_text(encoding="utf-8")).get("format") == EXPORT_FORMAT
    except (OSError, UnicodeDecodeError, ValueError, AttributeError):
        return False


def weights_sha256(state: dict) -> str:
    """The identity of the weights an export holds: sha256 over each tensor's name, dtype, shape and bytes, in name
    order (a tied tensor once), whatever the layout they are written in."""
    digest = hashlib.sha256()
    tensors, _ = untie(state)
    for name in sorted(tensors):
        t = tensors[name].detach().cpu().contiguous().reshape(-1)
        digest.update(f"{name}\0{t.dtype}\0{tuple(tensors[name].shape)}\0".encode())
        digest.update(t.view(torch.uint8).numpy())
    return digest.hexdigest()


def other_checkpoint(out: Path, source: dict) -> str | None:
    """How the finished export in `out` names its checkpoint when that is another one than `source` (export_config's
    record of this export's); None for the same one, or an unfinished export. Exports that record their weights'
    sha256 are the same when it is; older ones when their checkpoint path and step are."""
    record = out / (META if (out / META).is_file() else CONFIG)
    try:
        theirs = json.loads(record.read_text(encoding="utf-8")).get("source") or {}
    except (OSError, UnicodeDecodeError, ValueError, AttributeError):
        return None  # previous_export read it; a record gone since is an unfinished export
    if not isinstance(theirs, dict):
        return "an unknown checkpoint"
    if theirs.get("weights_sha256") and source.get("weights_sha256"):
        same = theirs["weights_sha256"] == source["weights_sha256"]
    else:
        same = (theirs.get("checkpoint"), theirs.get("step")) == (source.get("checkpoint"), source.get("step"))
    return None if same else f"{cut(str(theirs.get('checkpoint')))}, step {theirs.get('step')}"


def check_replace(out: Path, overwrite: bool, source: dict) -> bool:
    """Refuse an `out` that is a file, holds something other than an export, or holds the export of another
    checkpoint, unless `overwrite`; or that an interrupted swap left without its earlier export (swap_in). Returns
    whether `out` holds a previous export, whose eval.json then goes with it (it scored the weights replaced)."""
    if out.exists() and not out.is_dir():
        raise TrainError(f"{out} is a file; the export is a folder: give a new or empty folder")
    if not out.is_dir() or not any(out.iterdir()):
        where = out.absolute()
        aside = sorted(where.parent.glob(f".{glob.escape(where.name)}.old-*")) if where.parent.is_dir() else []
        if aside and not out.exists():
            raise TrainError(f"an export into {out} was interrupted while it replaced an earlier one, which is in "
                             f"{aside[0]}: rename that back to {out.name} (or delete it), then export again")
        return False
    if not previous_export(out):
        if not overwrite:
            raise TrainError(f"{out} is not empty and is not a vltrain export; choose another OUT, or add --overwrite "
                             f"(which replaces only the export's files: "
                             f"{', '.join(n for n in EXPORT_FILES if not n.endswith('.tmp'))})")
        return False
    other = other_checkpoint(out, source)
    if other and not overwrite:
        raise TrainError(f"{out} holds the export of another checkpoint ({other}); add --overwrite to replace it, "
                         "or choose another OUT")
    return True


@contextlib.contextmanager
def staged(out: Path):
    """A new folder beside `out` (.OUT.tmp-XXXXXXXX: the same filesystem, so swap_in renames) to write the export
    in; on a failure its export files are removed (and the folder, when nothing else is left in it). An OSError on it
    names `out`, the folder the user gave (a full disk: "cannot write OUT"). A killed export leaves the folder behind,
    never a half export at OUT."""
    out = out.absolute()  # "." has no name to put beside it
    if out.parent.exists() and not out.parent.is_dir():
        raise NotADirectoryError(errno.ENOTDIR, os.strerror(errno.ENOTDIR), str(out))
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.tmp-{secrets.token_hex(4)}"
    try:
        tmp.mkdir()
        yield tmp
    except BaseException as e:
        for name in EXPORT_FILES:  # only what the export wrote: a user's file swap_in could not put back stays
            path = tmp / name
            shutil.rmtree(path, ignore_errors=True) if path.is_dir() else path.unlink(missing_ok=True)
        with contextlib.suppress(OSError):
            tmp.rmdir()
        where = Path(os.fsdecode(e.filename)) if isinstance(e, OSError) and e.filename else None
        if where is not None and (where.name.startswith(f".{out.name}.") or tmp in where.parents):
            raise OSError(e.errno, e.strerror, str(out)) from None
        raise


def swap_in(tmp: Path, out: Path, previous: bool) -> None:
    """Make the complete export in `tmp` the folder `out`. The user's other files in `out` (an --overwrite of a
    folder that was not only an export) move into it first; then one atomic exchange of the two folders (Linux's
    renameat2), or where there is none `out` renamed aside to .OUT.old-XXXXXXXX and `tmp` renamed to `out`; then the
    earlier export is deleted. So `out` holds the earlier export or the new one at every moment (with the rename
    pair, for the instant between the two renames, the earlier one lies in .OUT.old-*, which check_replace points
    to). A failure puts the user's files back and leaves `out` as it was."""
    out = out.absolute()
    if not out.is_dir():
        os.rename(tmp, out)
        return
    ours = set(EXPORT_FILES) | {p.name for p in tmp.iterdir()} | ({EVAL} if previous else set())
    moved = []
    try:
        for entry in list(out.iterdir()):
            if entry.name not in ours:
                os.rename(entry, tmp / entry.name)
                moved.append(entry.name)
        old = tmp
        if not exchange(tmp, out):
            old = out.parent / f".{out.name}.old-{secrets.token_hex(4)}"
            os.rename(out, old)
            try:
                os.rename(tmp, out)
            except OSError:
                os.rename(old, out)
                raise
    except OSError:
        for name in moved:
            os.rename(tmp / name, out / name)
        raise
    shutil.rmtree(old, ignore_errors=True)  # the earlier export; a part left by a failure is only a stale copy


def exchange(a: Path, b: Path) -> bool:
    """Swap two existing paths in one step (Linux renameat2 with RENAME_EXCHANGE); False where the C library or the
    filesystem has no such call, and nothing happened."""
    try:
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):
        return False
    renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    at_fdcwd, rename_exchange = -100, 2  # <fcntl.h>, <linux/fs.h>
    if renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
        return False
    raise OSError(err, os.strerror(err), str(b))


def sidecar(path: Path) -> dict:
    """A run's JSON beside the checkpoint (result.json, eval.json) as a dict; {} when absent or unreadable: they only
    add provenance and numbers to the export."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def eval_numbers(ev: dict) -> dict | None:
    """eval.json's scores: the numbers of its retrieval, ITM re-rank and zero-shot parts (no lists or tables)."""
    numbers = {}
    for part in ("retrieval", "itm_rerank", "zeroshot"):
        if isinstance(ev.get(part), dict):
            numbers[part] = {k: v for k, v in ev[part].items()
                             if isinstance(v, (int, float)) and not isinstance(v, bool)}
    if numbers and ev.get("task"):
        numbers["task"] = ev["task"]
    return numbers or None


def preprocessing(net, config: dict) -> dict:
    """Every step from an image file and a caption to the graphs' inputs (vlprep.dataset.as_rgb, eval_transform,
    api.Model.tokens) spelled out, as docs/API.md does them in numpy; image keys None for a model that reads tokens."""
    mc = net.cfg
    features = mc.image_model == "features"
    pixels = net.image_mean is not None
    size = (net.image_size if features else config["data"]["image_size"]) if pixels else None
    from vltrain.model import image_interpolation, image_squash, model_tokenizer  # (the one vltrain.load pairs)

    how = image_interpolation(mc)  # bilinear, or a CLIP tower's own (bicubic for OpenAI's)
    squash = image_squash(mc)  # a SigLIP tower's processor resizes the whole image
    image = {"decode": "RGB; an RGBA, LA, PA or transparent P image composited on white first",
             "resize_to": "the whole image to image_size x image_size (no crop)" if squash else
             "shorter side to image_size, longer side int(image_size * longer / shorter) (rounded down)",
             "interpolation": how, "antialias": True, "align_corners": False,
             "resize_kernel": RESIZE_KERNEL if how == "bilinear" else
             f"torchvision.transforms.v2.functional.resize(uint8 image, interpolation={how}, antialias=True)",
             "crop": "centre image_size x image_size: top int(round((height - image_size) / 2)), left likewise "
                     "(Python's round: halves to even)",
             "scale": "uint8 to float32, times float32(1 / 255)", "normalize": "(x - mean) / std, float32",
             "channel_order": "RGB", "layout": "NCHW", "dtype": "float32"}
    tokenizer = model_tokenizer(net)
    text = {"tokenizer_files": TOKENIZER, "padding": "longest", "pad_token": tokenizer.pad_token,
            "pad_id": tokenizer.pad_token_id, "truncation": True,
            "max_length": config["data"]["max_len"], "model_max_length": export_length(net, config["data"]["max_len"]),
            "text_inputs": {"input_ids": "int64", "attention_mask": "int64"}}
    return {"image_input": "pixels" if pixels else "tokens", "image_size": size,
            "mean": list(net.image_mean) if pixels else None, "std": list(net.image_std) if pixels else None,
            "resize": RESIZE if pixels else None, "max_len": config["data"]["max_len"],
            **{k: v if pixels else None for k, v in image.items()}, **text}


def export_length(net, max_len: int) -> int:
    """The tokenizer's model_max_length in an export: data.max_len, the length the model was trained and is
    evaluated with, so that transformers' (and a processor's) truncation=True cuts a caption where vltrain.load does;
    a SigLIP text tower's full length instead, which it reads every caption padded to (padding="max_length" pads to
    model_max_length; data.max_len is at most that, and equal to it unless the user set it)."""
    pad = getattr(net, "text_pad", None)
    return int(pad[0]) if pad is not None else int(max_len)


def export_tokenizer(tokenizer, net, max_len: int):
    """A copy of the run's tokenizer (model_tokenizer's is shared: it stays as it is) whose model_max_length is
    export_length's, with no truncation or padding state in its tokenizer.json.

    A fast tokenizer keeps the truncation and padding of its last call in its Rust backend, and save_pretrained
    writes them into tokenizer.json, where transformers' truncation=True then still cuts at that call's length
    (the last training batch's data.max_len, whichever run of the process that was): the export would depend on
    what the process tokenized before."""
    tok = copy.deepcopy(tokenizer)
    tok.model_max_length = export_length(net, max_len)
    backend = getattr(tok, "backend_tokenizer", None) if getattr(tok, "is_fast", False) else None
    if backend is not None:
        backend.no_truncation()
        backend.no_padding()
    return tok


def export_source(ckpt: dict, path: Path, net) -> dict:
    """config.json's "source": the checkpoint (its path, step and the sha256 of the weights exported, which says
    whether a later export into the same OUT is of the same checkpoint), the data and the preset."""
    config = ckpt["config"]
    result = sidecar((path if path.is_dir() else path.parent) / "result.json")
    return {"checkpoint": str(path.resolve()), "step": ckpt.get("step", result.get("step")),
            "weights_sha256": weights_sha256(net.state_dict()),
            "data": ckpt.get("data") or result.get("data"), "preset": config.get("preset"),
            "shards": [redact(s) for s in config.get("shards") or []] or None}


def export_config(ckpt: dict, path: Path, net, tied: dict, dropped: list, onnx_info: dict | None,
                  source: dict) -> dict:
    """config.json: format, the checkpoint's whole config, preprocessing, tokenizer, provenance, eval numbers."""
    config = ckpt["config"]
    folder = path if path.is_dir() else path.parent
    ev = sidecar(folder / "eval.json")
    mc = net.cfg
    return {"format": EXPORT_FORMAT, "version": EXPORT_VERSION, "config": config,
            "preprocessing": preprocessing(net, config), "tokenizer": mc.text_model, "tokenizer_files": TOKENIZER,
            "feature_encoder": (mc.feature_encoder or None) if mc.image_model == "features" else None,
            "source": source, "eval": eval_numbers(ev),
            "dropped": {"prefixes": list(EXPORT_DROPS), "tensors": len(dropped),
                        "rebuilt_with": {f"model.{k}": v for k, v in EXPORT_MODEL.items()}},
            "tied": tied, "onnx": onnx_info}


def write_weights(net, out: Path) -> dict:
    """model.safetensors of `net`, every tensor once; returns `tied`: the further names of shared tensors."""
    tensors, tied = untie(net.state_dict())
    save_file(tensors, str(out / WEIGHTS), metadata={"format": "pt"})
    os.chmod(out / WEIGHTS, 0o644)  # safetensors writes 0600; an export is shared like its other files
    return tied


def write_config(meta: dict, out: Path) -> None:
    """config.json, last and atomically: from then on the folder is a complete export."""
    tmp = out / (CONFIG + ".tmp")
    tmp.write_text(json.dumps(meta, indent=2) + "\n", encoding="utf-8")
    os.replace(tmp, out / CONFIG)
