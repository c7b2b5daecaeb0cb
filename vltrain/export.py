"""`vltrain export CKPT OUT`: a trained model as a folder to ship, read back without pickle and without training state.

OUT holds model.safetensors (the weights inference reads: no optimiser state, RNG states, EMA copy or queues),
config.json (format, the run's config, preprocessing, tokenizer, provenance, eval numbers), tokenizer/ (the Hugging
Face tokenizer files), README.md and, with --onnx, image_encoder.onnx and text_encoder.onnx. config.json is written
last: a folder without it is an unfinished export, which vltrain.checkpoint.read_export refuses, so a failure never
leaves a half export that claims to be complete. `vltrain.load(OUT)` and every command that takes a checkpoint read
the folder (vltrain.checkpoint.load). docs/TRAINING.md, "Export".
"""

import json
import os
import shutil
import warnings
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import nn

from vlprep.urls import redact
from vltrain.checkpoint import EXPORT_DROPS, EXPORT_FORMAT, EXPORT_VERSION, load, model_from, untie
from vltrain.errors import TrainError
from vltrain.model import tokenizer_for

CONFIG, WEIGHTS, TOKENIZER, README = "config.json", "model.safetensors", "tokenizer", "README.md"
IMAGE_ONNX, TEXT_ONNX = "image_encoder.onnx", "text_encoder.onnx"
# Every name an export writes (config.json's temporary file included): all that exporting again replaces.
EXPORT_FILES = (CONFIG, CONFIG + ".tmp", WEIGHTS, TOKENIZER, README, IMAGE_ONNX, TEXT_ONNX)
# What `vltrain eval EXPORT` writes into an export by default: still an export, and its scores go with its weights,
# so exporting again over a previous export removes it (it scored the weights replaced).
EVAL = "eval.json"
RESIZE = "shorter side then centre crop"
ONNX_OPSET = 17  # LayerNormalization is one ONNX op from opset 17
ONNX_TOLERANCE = 1e-4  # max abs difference of the ONNX embeddings from torch's that the export accepts


def export(checkpoint, out, onnx: bool = False, overwrite: bool = False) -> dict:
    """Write the export of `checkpoint` (a `vltrain run` checkpoint, or an export) into the folder `out`.

    Refuses a non-empty `out` that holds anything but a previous export unless `overwrite` (which replaces only an
    export's files, EXPORT_FILES). Returns {"out", "files", "dropped": the state-dict names left out, "onnx"}."""
    checkpoint, out = Path(checkpoint), Path(out)
    ckpt = load(checkpoint)
    kept = {k: v for k, v in ckpt["model"].items() if not k.startswith(EXPORT_DROPS)}
    dropped = sorted(set(ckpt["model"]) - set(kept))
    # The model an export rebuilds (no EMA copy, no queues), with the checkpoint's weights checked by name and shape.
    net = model_from({**ckpt, "model": kept, "export": True}, checkpoint).eval()
    tokenizer = tokenizer_for(net.cfg.text_model)
    onnx_info = None

    prepare_out(out, overwrite)
    tensors, tied = untie(net.state_dict())
    save_file(tensors, str(out / WEIGHTS), metadata={"format": "pt"})
    os.chmod(out / WEIGHTS, 0o644)  # safetensors writes 0600; an export is meant to be shared like its other files
    tokenizer.save_pretrained(str(out / TOKENIZER))
    warnings_ = []
    if onnx:
        onnx_info = write_onnx(net, ckpt["config"], tokenizer, out)
        if not itc_trained(ckpt["config"]):
            onnx_info["itc_trained"] = False
            warnings_.append(UNTRAINED_ITC)
    meta = export_config(ckpt, checkpoint, net, tied, dropped, onnx_info)
    (out / README).write_text(readme(meta, out), encoding="utf-8")
    tmp = out / (CONFIG + ".tmp")  # last, and atomically: from now on the folder is a complete export
    tmp.write_text(json.dumps(meta, indent=2) + "\n", encoding="utf-8")
    os.replace(tmp, out / CONFIG)
    files = [WEIGHTS, CONFIG, TOKENIZER + "/", README] + ([IMAGE_ONNX, TEXT_ONNX] if onnx else [])
    return {"out": str(out), "files": files, "dropped": dropped, "onnx": onnx_info, "warnings": warnings_}


UNTRAINED_ITC = ("the ONNX graphs hold the ITC towers (image_proj, text_proj), and this model was trained with "
                 "loss.itc=0 (the TOnICS presets train the aligner instead), so their embeddings are untrained")


def itc_trained(config: dict) -> bool:
    """Whether the run trained the ITC projections the ONNX graphs end in: loss.itc > 0 (focal ITC scales with it)
    or GRIT's ITC consistency loss.consistency > 0."""
    loss = config.get("loss") or {}
    return float(loss.get("itc", 1.0)) > 0 or float(loss.get("consistency", 0.0)) > 0


# --- the folder -------------------------------------------------------------------------------------------------


def previous_export(out: Path) -> bool:
    """Whether `out` holds nothing but an export's files (finished, or unfinished: no config.json yet), so that
    exporting again may replace them without --overwrite; a finished one may also hold the eval.json of `vltrain
    eval EXPORT`."""
    names = {p.name for p in out.iterdir()}
    if not names <= set(EXPORT_FILES) | {EVAL}:
        return False
    if CONFIG not in names:
        return EVAL not in names  # an eval.json without an export's config.json is not ours to remove
    try:
        return json.loads((out / CONFIG).read_text(encoding="utf-8")).get("format") == EXPORT_FORMAT
    except (OSError, UnicodeDecodeError, ValueError, AttributeError):
        return False


def prepare_out(out: Path, overwrite: bool) -> None:
    """Refuse an `out` that holds something other than an export unless `overwrite`; remove a previous export's files,
    config.json first (the folder is an unfinished export from then on), and create the folder."""
    if out.exists() and not out.is_dir():
        raise TrainError(f"{out} is a file; the export is a folder: give a new or empty folder")
    previous = out.is_dir() and any(out.iterdir()) and previous_export(out)
    if out.is_dir() and any(out.iterdir()) and not previous and not overwrite:
        raise TrainError(f"{out} is not empty and is not a vltrain export; choose another OUT, or add --overwrite "
                         f"(which replaces only the export's files: "
                         f"{', '.join(n for n in EXPORT_FILES if not n.endswith('.tmp'))})")
    for name in EXPORT_FILES + ((EVAL,) if previous else ()):  # anything else in the folder is the user's
        target = out / name
        if target.is_dir() and not target.is_symlink():
            shutil.rmtree(target)
        elif target.exists() or target.is_symlink():
            target.unlink()
    out.mkdir(parents=True, exist_ok=True)


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
    """What the image and text inputs must be: the eval transform's size and statistics (api.pixel_transform) and the
    text length the model was trained with; a features model without an encoder record reads tokens only."""
    mc = net.cfg
    features = mc.image_model == "features"
    pixels = net.image_mean is not None
    return {"image_input": "pixels" if pixels else "tokens",
            "image_size": (net.image_size if features else config["data"]["image_size"]) if pixels else None,
            "mean": list(net.image_mean) if pixels else None, "std": list(net.image_std) if pixels else None,
            "resize": RESIZE if pixels else None, "max_len": config["data"]["max_len"]}


def export_config(ckpt: dict, path: Path, net, tied: dict, dropped: list, onnx_info: dict | None) -> dict:
    """config.json: format, the checkpoint's whole config, preprocessing, tokenizer, provenance, eval numbers."""
    config = ckpt["config"]
    folder = path if path.is_dir() else path.parent
    result, ev = sidecar(folder / "result.json"), sidecar(folder / "eval.json")
    mc = net.cfg
    source = {"checkpoint": str(path.resolve()), "step": ckpt.get("step", result.get("step")),
              "data": ckpt.get("data") or result.get("data"), "preset": config.get("preset"),
              "shards": [redact(s) for s in config.get("shards") or []] or None}
    return {"format": EXPORT_FORMAT, "version": EXPORT_VERSION, "config": config,
            "preprocessing": preprocessing(net, config), "tokenizer": mc.text_model, "tokenizer_files": TOKENIZER,
            "feature_encoder": (mc.feature_encoder or None) if mc.image_model == "features" else None,
            "source": source, "eval": eval_numbers(ev),
            "dropped": {"prefixes": list(EXPORT_DROPS), "tensors": len(dropped),
                        "rebuilt_with": {"model.momentum": False, "model.queue_size": 0}},
            "tied": tied, "onnx": onnx_info}


# --- ONNX -------------------------------------------------------------------------------------------------------


class ImageTower(nn.Module):
    """encode_image's ITC embedding alone: pixels (B, 3, S, S), or a features model's tokens (B, N, D) -> (B, E)."""

    def __init__(self, net):
        super().__init__()
        self.net = net

    def forward(self, images):
        return self.net.encode_image(images)[1]


class TextTower(nn.Module):
    """encode_text's ITC embedding alone: input_ids, attention_mask (B, L) int64 -> (B, E)."""

    def __init__(self, net):
        super().__init__()
        self.net = net

    def forward(self, input_ids, attention_mask):
        return self.net.encode_text(input_ids, attention_mask)[1]


def example_inputs(net, config: dict, tokenizer, n: int) -> tuple[torch.Tensor, dict]:
    """n images (normalised pixels, or feature tokens) and n captions of different lengths, padded to the longest:
    the trace sees a padded attention mask, and the check another batch size and length than the trace."""
    gen = torch.Generator().manual_seed(n)
    if net.cfg.image_model == "features":  # the graph reads the cached tokens (write_onnx says why)
        tokens = int(net.cfg.feature_encoder.get("tokens") or 4) + n - 2  # and the check another token count
        images = torch.randn(n, tokens, net.cfg.feature_dim, generator=gen)
    else:
        size = config["data"]["image_size"]
        images = torch.randn(n, 3, size, size, generator=gen)
    words = ["a photo of", "a red", "dog", "on the grass", "next to a small", "blue car", "and", "a tree"]
    texts = [" ".join(words[:2 + (i * 3) % len(words)]) for i in range(n)]
    enc = tokenizer(texts, padding="longest", truncation=True, max_length=config["data"]["max_len"],
                    return_tensors="pt")
    return images, {k: enc[k].to(torch.int64) for k in ("input_ids", "attention_mask")}


def write_onnx(net, config: dict, tokenizer, out: Path) -> dict:
    """image_encoder.onnx and text_encoder.onnx (dynamic batch; dynamic length for text, and token count for a
    features model's tokens), checked with onnxruntime against torch on a batch of another size than the trace's.

    A model trained on `vlprep features` tokens gets an image graph over those tokens (B, N, D), not over pixels:
    its frozen encoder is no part of the model or its weights (vltrain.model.VLModel.pixel_tokens loads it from
    the packaged or recorded weights), and config.json's feature_encoder names it, so the tokens come from where
    they always come from, `vlprep features` or that encoder."""
    try:
        import onnx  # noqa: F401  (the exporter serialises with it)
        import onnxruntime
    except ImportError:
        raise TrainError("--onnx needs onnx and onnxruntime: pip install 'vlprep-vltrain[onnx]' (`make install` "
                         "has them)") from None
    image_name = "tokens" if net.cfg.image_model == "features" else "pixels"
    image_axes = {0: "batch"} if image_name == "pixels" else {0: "batch", 1: "tokens"}
    images, text = example_inputs(net, config, tokenizer, 2)
    # torch.onnx.export restores each wrapper's training mode afterwards, and that recursively sets the model's: the
    # wrappers must be in eval mode, or dropout would be on after the export.
    image_tower, text_tower = ImageTower(net).eval(), TextTower(net).eval()
    with warnings.catch_warnings():
        # The TorchScript exporter's deprecation notice, and tracer notes on Python bools in transformers' mask code
        # (no padding beyond the mask, not causal), which hold for every batch and length: the check below runs both.
        warnings.simplefilter("ignore")
        torch.onnx.export(image_tower, (images,), str(out / IMAGE_ONNX), input_names=[image_name],
                          output_names=["embedding"], dynamic_axes={image_name: image_axes, "embedding": {0: "batch"}},
                          opset_version=ONNX_OPSET, dynamo=False)
        text_axes = {0: "batch", 1: "length"}
        torch.onnx.export(text_tower, (text["input_ids"], text["attention_mask"]), str(out / TEXT_ONNX),
                          input_names=["input_ids", "attention_mask"], output_names=["embedding"],
                          dynamic_axes={"input_ids": text_axes, "attention_mask": text_axes, "embedding": {0: "batch"}},
                          opset_version=ONNX_OPSET, dynamo=False)
    images, text = example_inputs(net, config, tokenizer, 3)
    with torch.no_grad():
        want_image, want_text = image_tower(images), text_tower(text["input_ids"], text["attention_mask"])
    opts = onnxruntime.SessionOptions()
    opts.log_severity_level = 3
    got_image = onnxruntime.InferenceSession(str(out / IMAGE_ONNX), opts, providers=["CPUExecutionProvider"]).run(
        None, {image_name: images.numpy()})[0]
    got_text = onnxruntime.InferenceSession(str(out / TEXT_ONNX), opts, providers=["CPUExecutionProvider"]).run(
        None, {k: v.numpy() for k, v in text.items()})[0]
    diff = {"image": float((torch.from_numpy(got_image) - want_image).abs().max()),
            "text": float((torch.from_numpy(got_text) - want_text).abs().max())}
    if max(diff.values()) > ONNX_TOLERANCE:
        raise TrainError(f"the ONNX graphs do not reproduce the model (max abs difference image {diff['image']:.2g}, "
                         f"text {diff['text']:.2g} > {ONNX_TOLERANCE:g}); export without --onnx")
    e = net.cfg.embed_dim
    image_shape = ["batch", 3, images.shape[2], images.shape[3]] if image_name == "pixels" else \
        ["batch", "tokens", net.cfg.feature_dim]
    exporter = f"torch.onnx.export (TorchScript, dynamo=False), torch {torch.__version__}"
    return {"opset": ONNX_OPSET, "exporter": exporter,
            "image": {"file": IMAGE_ONNX, "input": {"name": image_name, "dtype": "float32", "shape": image_shape},
                      "output": {"name": "embedding", "dtype": "float32", "shape": ["batch", e]}},
            "text": {"file": TEXT_ONNX,
                     "inputs": [{"name": n, "dtype": "int64", "shape": ["batch", "length"]}
                                for n in ("input_ids", "attention_mask")],
                     "output": {"name": "embedding", "dtype": "float32", "shape": ["batch", e]}},
            "max_abs_diff": diff}


# --- README -----------------------------------------------------------------------------------------------------


def readme(meta: dict, out: Path) -> str:
    """README.md of the export: what the model is, what it was trained on, its eval numbers, how to load it."""
    config, source, pre, mc = meta["config"], meta["source"], meta["preprocessing"], meta["config"]["model"]
    fusion = mc["fusion_layers"]
    towers = (f"image tower `{mc['image_model']}`"
              + (f" (reads `vlprep features` tokens of `{meta['feature_encoder']['encoder']}`)"
                 if meta.get("feature_encoder") else " (reads `vlprep features` tokens)"
                 if mc["image_model"] == "features" else "")
              + f", text tower `{mc['text_model']}`")
    lines = [f"# {out.name}: a vltrain export", "",
             f"A vision-language model trained by vltrain with the `{source['preset']}` preset: {towers}, "
             f"{mc['embed_dim']}-dimensional ITC embeddings, "
             + (f"{fusion} fusion layer{'s' if fusion > 1 else ''} (ITM head)." if fusion
                else "no fusion encoder (a dual encoder)."), "",
             "## Training", "",
             f"- preset `{source['preset']}`, {source['step'] if source['step'] is not None else 'unknown'} steps "
             f"(batch size {config.get('batch_size')})",
             f"- data: {', '.join(map(redact, source.get('shards') or [])) or 'unknown'}",
             f"- data signature: `{source['data']}`" if source.get("data") else "- data signature: unknown",
             f"- checkpoint: `{source['checkpoint']}`", ""]
    ev = meta.get("eval")
    if ev:
        lines += ["## Evaluation (eval.json beside the checkpoint)", ""]
        if "retrieval" in ev:
            r = ev["retrieval"]
            lines += ["| | TR@1 | TR@5 | TR@10 | IR@1 | IR@5 | IR@10 | mean |", "|---|---|---|---|---|---|---|---|"]
            for name, row in (("ITC", r), ("ITM re-rank", ev.get("itm_rerank"))):
                if row:
                    lines.append(f"| {name} | " + " | ".join(
                        f"{row[k]:.2f}" if k in row else "" for k in
                        ("i2t_r1", "i2t_r5", "i2t_r10", "t2i_r1", "t2i_r5", "t2i_r10", "mean_recall")) + " |")
            lines.append("")
        if "zeroshot" in ev and "top1" in ev["zeroshot"]:
            zs = ev["zeroshot"]
            lines += [f"Zero-shot: top-1 {zs['top1']:.2f} %, top-5 {zs.get('top5', float('nan')):.2f} % over "
                      f"{zs.get('classes', '?')} classes.", ""]
    stats = (f"{pre['image_size']} x {pre['image_size']} RGB, {pre['resize']}, scaled to [0, 1] and normalised with "
             f"mean {[round(v, 4) for v in pre['mean']]} and std {[round(v, 4) for v in pre['std']]}"
             if pre["image_input"] == "pixels" else "")
    if mc["image_model"] != "features":
        image_in = stats
    elif stats:
        image_in = (f"{stats}, which vltrain runs through the frozen `{meta['feature_encoder']['encoder']}` encoder; "
                    "the ONNX image graph reads that encoder's tokens, as `vlprep features` caches them")
    else:
        image_in = "the cached `vlprep features` tokens only (the export has no record of their encoder)"
    lines += ["## Files", "",
              "- `model.safetensors`: the weights inference reads (no optimiser, RNG, momentum copy or queues)",
              "- `config.json`: format, the run's config, preprocessing, provenance, eval numbers",
              "- `tokenizer/`: the Hugging Face tokenizer (`AutoTokenizer.from_pretrained`), "
              f"captions truncated to {pre['max_len']} tokens"]
    if meta.get("onnx") and meta["onnx"].get("itc_trained") is False:
        lines += [f"- note: {UNTRAINED_ITC}; use `vltrain.load` and the aligner, not the ONNX graphs"]
    if meta.get("onnx"):
        image = meta["onnx"]["image"]["input"]
        lines += [f"- `{IMAGE_ONNX}`: `{image['name']}` float32 ({', '.join(map(str, image['shape']))}) -> "
                  f"`embedding` (batch, {mc['embed_dim']}), L2-normalised",
                  f"- `{TEXT_ONNX}`: `input_ids`, `attention_mask` int64 (batch, length) -> `embedding` "
                  f"(batch, {mc['embed_dim']}), L2-normalised"]
    lines += ["", f"Images: {image_in}.", "", "## Loading", "", "```python", "import vltrain", "",
              f'model = vltrain.load("{out.name}")  # json and safetensors only: no pickle',
              'img = model.encode_images(["a.png"])', 'txt = model.encode_texts(["a dog"])', "```", ""]
    return "\n".join(lines)
