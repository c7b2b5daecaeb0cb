"""`vltrain export CKPT OUT`: a model as a folder to ship (vltrain.exportfmt), ONNX, README."""

import warnings
from pathlib import Path

import torch
from torch import nn

from vlprep import VlprepError
from vlprep.output import check_out
from vlprep.urls import redact
from vltrain.checkpoint import load, model_from
from vltrain.errors import TrainError
from vltrain import hfclip, hub, openclip
from vltrain.export_hf import FORMATS, check_hf, hf_meta, hf_readme, write_hf, write_meta, write_open_clip
from vltrain.exportfmt import (CONFIG, EXPORT_DROPS, HEADS, IMAGE_ONNX, IMAGE_TOKENS_ONNX, META, README, TEXT_ONNX,
                               TOKENIZER, WEIGHTS, check_replace, export_config, export_source, export_tokenizer,
                               staged, swap_in, write_config, write_weights)
from vltrain.model import _tokenizer_at, model_tokenizer

# `vltrain.load(OUT)` and every command that takes a checkpoint read the folder (vltrain.checkpoint.load).
# docs/TRAINING.md, "Export".

ONNX_OPSET = 17  # LayerNormalization is one ONNX op from opset 17
ONNX_TOLERANCE = 1e-4  # max abs difference of the ONNX embeddings from torch's that the export accepts


def export(checkpoint, out, onnx: bool = False, overwrite: bool = False, fmt: str = "vltrain",
           shown: str | None = None) -> dict:
    """Write the export of `checkpoint` (a `vltrain run` checkpoint, or an export) into the folder `out`: in vltrain's
    layout (fmt "vltrain"), or as transformers' CLIPModel / VisionTextDualEncoderModel with vltrain's other heads
    beside it (fmt "hf", vltrain.export_hf).

    The export is written in a folder beside `out` and swapped in when complete (vltrain.exportfmt.swap_in), so
    `out` holds the earlier export or the new one at every moment. Refuses an `out` that overlaps what the export
    reads, and unless `overwrite` one that holds something other than an export, or the export of another checkpoint
    (`overwrite` replaces only an export's files, EXPORT_FILES). Returns {"out", "files", "dropped": the state-dict
    names left out, "onnx"}. `checkpoint` may be the URL of a checkpoint file: downloaded once with the result.json
    and eval.json beside it (provenance, eval numbers), removed after (vltrain.fetchckpt), recorded redacted."""
    from vltrain.fetchckpt import SIDECARS, is_url, local_checkpoint

    if is_url(checkpoint):
        with local_checkpoint(checkpoint, SIDECARS) as local:
            return export(local, out, onnx, overwrite, fmt, shown=redact(checkpoint))
    checkpoint = Path(checkpoint)
    out = Path(out)
    out = out.resolve() if out.is_symlink() else out  # the folder it names is the one replaced, not the link
    check_apart(out, [checkpoint])  # before reading: OUT itself may be the export given as CKPT
    ckpt = load(checkpoint)
    kept = {k: v for k, v in ckpt["model"].items() if not k.startswith(EXPORT_DROPS)}
    dropped = sorted(set(ckpt["model"]) - set(kept))
    # The model an export rebuilds (no EMA copy, no queues), with the checkpoint's weights checked by name and shape.
    net = model_from({**ckpt, "model": kept, "export": True}, checkpoint).eval()
    check_apart(out, [checkpoint, *tower_folders(net)])  # a CLIP tower's folder: its tokenizer is read
    # its model_max_length the length the model was trained with: other libraries' truncation=True cuts there too
    tokenizer = export_tokenizer(model_tokenizer(net), net, ckpt["config"]["data"]["max_len"])
    onnx_info = None
    if fmt not in FORMATS:
        raise TrainError(f"--format must be one of {', '.join(FORMATS)}, got {fmt!r}"[:160])
    if fmt != "vltrain":
        check_hf(net, fmt)  # before OUT is touched: a model the library cannot hold is one line, OUT as it was
    source = export_source(ckpt, checkpoint, net)
    if shown is not None:  # a downloaded copy: the URL (redacted) is the checkpoint, not the temporary file
        source["checkpoint"] = shown
    previous = check_replace(out, overwrite, source)
    warnings_ = []
    with staged(out) as tmp:  # every file goes here first; OUT is untouched until the swap
        if fmt != "vltrain":
            hf = write_hf(net, tokenizer, tmp) if fmt == "hf" else write_open_clip(net, tokenizer, tmp)
            tied = hf["tied"]
        else:
            tied = write_weights(net, tmp)
            tokenizer.save_pretrained(str(tmp / TOKENIZER))
        if onnx:
            onnx_info = write_onnx(net, ckpt["config"], tokenizer, tmp)
            if not itc_trained(ckpt["config"]):
                onnx_info["itc_trained"] = False
                warnings_.append(UNTRAINED_ITC)
        meta = export_config(ckpt, checkpoint, net, tied, dropped, onnx_info, source)
        if fmt != "vltrain":
            meta = hf_meta(meta, hf, fmt)
            (tmp / README).write_text(hf_readme(readme(meta, out), meta, out), encoding="utf-8")
            write_meta(meta, tmp)
            files = ([CONFIG, WEIGHTS, "tokenizer and image processor files"] if fmt == "hf"
                     else [openclip.CONFIG, openclip.WEIGHTS]) + [HEADS, META, README]
        else:
            (tmp / README).write_text(readme(meta, out), encoding="utf-8")
            write_config(meta, tmp)
            files = [WEIGHTS, CONFIG, TOKENIZER + "/", README]
        swap_in(tmp, out, previous)
    _tokenizer_at.cache_clear()  # a tokenizer read from an earlier export at OUT is not this one's
    files += [v["file"] for v in (onnx_info or {}).values() if isinstance(v, dict) and "file" in v]
    return {"out": str(out), "files": files, "dropped": dropped, "onnx": onnx_info, "warnings": warnings_}


def check_apart(out: Path, inputs: list) -> None:
    """A one-line error when OUT is an input of the export, holds one, or lies inside one (vlprep.output.check_out):
    the swap would move it aside, or the export would write into what it reads."""
    try:
        check_out(out, *inputs)
    except VlprepError as e:
        raise TrainError(str(e)) from None


def tower_folders(net) -> list[Path]:
    """The local folders of the model's clip:PATH towers (hf-hub: ones live in the hub's cache)."""
    specs = {net.cfg.text_model, net.cfg.image_model}
    return [Path(s[len(hfclip.PREFIX):]) for s in specs if hfclip.is_clip(s) and not hub.is_hub(s[len(hfclip.PREFIX):])]


def max_length_note(pre: dict) -> str:
    """The README's words on the tokenizer's model_max_length (exportfmt.export_length), for `preprocessing` `pre`."""
    longest = pre.get("model_max_length", pre["max_len"])
    if longest == pre["max_len"]:
        return " (its `model_max_length`, which `truncation=True` cuts at)"
    return (f" (a SigLIP text tower reads every caption padded to {longest} tokens, its `model_max_length`: cut a "
            f"caption at {pre['max_len']} with `truncation=True, max_length={pre['max_len']}`, then pad it to "
            f"{longest})")


UNTRAINED_ITC = ("the ONNX graphs hold the ITC towers (image_proj, text_proj), and this model was trained with "
                 "loss.itc=0 (the TOnICS presets train the aligner instead), so their embeddings are untrained")


def itc_trained(config: dict) -> bool:
    """Whether the run trained the ITC projections the ONNX graphs end in: loss.itc > 0 (focal ITC scales with it)
    or GRIT's ITC consistency loss.consistency > 0."""
    loss = config.get("loss") or {}
    return float(loss.get("itc", 1.0)) > 0 or float(loss.get("consistency", 0.0)) > 0


# --- ONNX -------------------------------------------------------------------------------------------------------


class ImageTower(nn.Module):
    """encode_image's ITC embedding alone: pixels (B, 3, S, S) (a features model's through its frozen encoder,
    VLModel.pixel_tokens), or a features model's tokens (B, N, D) -> (B, E)."""

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


def image_graphs(net) -> list[tuple[str, str, str]]:
    """(key in config.json's onnx, file, input name) of each image graph: one from pixels wherever the model can read
    them (a features model through its recorded encoder), and a features model's graph over its cached tokens."""
    if net.cfg.image_model != "features":
        return [("image", IMAGE_ONNX, "pixels")]
    if not net.cfg.feature_encoder:  # no record of the encoder: the tokens are all it can read
        return [("image", IMAGE_ONNX, "tokens")]
    return [("image", IMAGE_ONNX, "pixels"), ("image_tokens", IMAGE_TOKENS_ONNX, "tokens")]


def example_images(net, config: dict, n: int, image_input: str) -> torch.Tensor:
    """n random normalised pixels (n, 3, S, S), or feature tokens (n, N, D)."""
    gen = torch.Generator().manual_seed(n)
    if image_input == "tokens":
        tokens = int(net.cfg.feature_encoder.get("tokens") or 4) + n - 2  # the check sees another count than the trace
        return torch.randn(n, tokens, net.cfg.feature_dim, generator=gen)
    size = net.image_size if net.cfg.image_model == "features" else config["data"]["image_size"]
    return torch.randn(n, 3, size, size, generator=gen)


def example_texts(config: dict, tokenizer, n: int) -> dict:
    """n captions of different lengths, padded to the longest: the trace sees a padded attention mask, and the check
    another batch size and length than the trace."""
    words = ["a photo of", "a red", "dog", "on the grass", "next to a small", "blue car", "and", "a tree"]
    texts = [" ".join(words[:2 + (i * 3) % len(words)]) for i in range(n)]
    enc = tokenizer(texts, padding="longest", truncation=True, max_length=config["data"]["max_len"],
                    return_tensors="pt")
    return {k: enc[k].to(torch.int64) for k in ("input_ids", "attention_mask")}


def trace(tower: nn.Module, inputs: dict, axes: dict, path: Path) -> None:
    """torch.onnx.export of `tower` on `inputs` {name: tensor} with their dynamic `axes`, to `path`."""
    with warnings.catch_warnings():
        # The TorchScript exporter's deprecation notice, and tracer notes on Python bools in transformers' mask code
        # (no padding beyond the mask, not causal), which hold for every batch and length: the check runs both.
        warnings.simplefilter("ignore")
        torch.onnx.export(tower, tuple(inputs.values()), str(path), input_names=list(inputs),
                          output_names=["embedding"], dynamic_axes={**axes, "embedding": {0: "batch"}},
                          opset_version=ONNX_OPSET, dynamo=False)


def ort_run(graph, inputs: dict) -> list:
    """onnxruntime's outputs of `graph` (a path, or a serialised model) for `inputs` {name: tensor}, as numpy."""
    import onnxruntime

    opts = onnxruntime.SessionOptions()
    opts.log_severity_level = 3
    graph = str(graph) if isinstance(graph, Path) else graph
    session = onnxruntime.InferenceSession(graph, opts, providers=["CPUExecutionProvider"])
    return session.run(None, {k: v.numpy() for k, v in inputs.items()})


def ort_diff(path: Path, inputs: dict, want: torch.Tensor) -> float:
    """Max abs difference of onnxruntime's output for `inputs` {name: tensor} from torch's `want`."""
    return float((torch.from_numpy(ort_run(path, inputs)[0]) - want).abs().max())


def with_encoder_tokens(path: Path) -> bytes | None:
    """The image graph at `path` with a second output: its frozen encoder's float32 tokens, the input of its one Cast
    to float16 (the dtype `vlprep features` stored them in); None for a graph without one (stored as float32)."""
    import onnx

    model = onnx.load(str(path))
    to16 = [n.input[0] for n in model.graph.node
            if n.op_type == "Cast" and onnx.helper.get_attribute_value(n.attribute[0]) == onnx.TensorProto.FLOAT16]
    if len(to16) != 1:
        return None
    model.graph.output.append(onnx.helper.make_tensor_value_info(to16[0], onnx.TensorProto.FLOAT, None))
    return model.SerializeToString()


def encoder_diff(net, tower: nn.Module, graph: bytes, images: torch.Tensor) -> tuple[float, float]:
    """A features model's pixels graph (with_encoder_tokens) in two parts: (max abs difference of its embedding from
    torch's on the graph's own tokens rounded to float16, that of its encoder's float32 tokens from torch's)."""
    # Not end to end: two encoders that agree to float32 rounding still round a token to either side of a float16
    # step now and then, which moves the embedding by more than float32 rounding.
    got, tokens = ort_run(graph, {"pixels": images})
    with torch.no_grad():
        want_tokens = net._pixel_encoder(images)  # built by the model's first pixel input (VLModel.pixel_tokens)
        want = tower(torch.from_numpy(tokens).half().float())
    head = float((torch.from_numpy(got) - want).abs().max())
    return head, float((torch.from_numpy(tokens) - want_tokens).abs().max())


def write_onnx(net, config: dict, tokenizer, out: Path) -> dict:
    """image_encoder.onnx and text_encoder.onnx (dynamic batch; dynamic length for text, and token count for a
    features model's tokens), checked with onnxruntime against torch on a batch of another size than the trace's.

    A model trained on `vlprep features` tokens whose export records their encoder (config.json's feature_encoder)
    gets an image graph from pixels, that frozen encoder and the model in one (VLModel.pixel_tokens, with its cast to
    the stored dtype and back), and image_tokens_encoder.onnx over the cached tokens (B, N, D) beside it; without a
    record, image_encoder.onnx is the tokens graph, and the tokens must come from `vlprep features`."""
    try:
        import onnx  # noqa: F401  (the exporter serialises with it)
        import onnxruntime  # noqa: F401  (the check runs the graphs with it)
    except ImportError:
        raise TrainError("--onnx needs onnx and onnxruntime: pip install 'vlprep-vltrain[onnx]' (`make install` "
                         "has them)") from None
    # torch.onnx.export restores each wrapper's training mode afterwards, and that recursively sets the model's: the
    # wrappers must be in eval mode, or dropout would be on after the export.
    image_tower = ImageTower(net).eval()
    text_tower = TextTower(net).eval()
    e = net.cfg.embed_dim
    output = {"name": "embedding", "dtype": "float32", "shape": ["batch", e]}
    exporter = f"torch.onnx.export (TorchScript, dynamo=False), torch {torch.__version__}"
    info = {"opset": ONNX_OPSET, "exporter": exporter}
    diff = {}
    for key, file, name in image_graphs(net):
        images = example_images(net, config, 3, name)
        try:
            with torch.no_grad():  # first: a features model builds its frozen encoder here, outside the trace
                want = image_tower(images)
        except VlprepError as e:  # the recorded encoder's weights are gone or changed
            raise TrainError(f"{e}; the ONNX image graph holds that encoder: restore its weights, or export without "
                             "--onnx") from None
        axes = {0: "batch"} if name == "pixels" else {0: "batch", 1: "tokens"}
        trace(image_tower, {name: example_images(net, config, 2, name)}, {name: axes}, out / file)
        shape = ["batch", 3, images.shape[2], images.shape[3]] if name == "pixels" else \
            ["batch", "tokens", net.cfg.feature_dim]
        info[key] = {"file": file, "input": {"name": name, "dtype": "float32", "shape": shape}, "output": output}
        graph = with_encoder_tokens(out / file) if name == "pixels" and net.cfg.image_model == "features" else None
        if graph is None:
            diff[key] = ort_diff(out / file, {name: images}, want)
        else:
            diff[key], diff[f"{key}_encoder"] = encoder_diff(net, image_tower, graph, images)
    text = example_texts(config, tokenizer, 2)
    text_axes = {0: "batch", 1: "length"}
    trace(text_tower, text, {"input_ids": text_axes, "attention_mask": text_axes}, out / TEXT_ONNX)
    text = example_texts(config, tokenizer, 3)
    with torch.no_grad():
        diff["text"] = ort_diff(out / TEXT_ONNX, text, text_tower(text["input_ids"], text["attention_mask"]))
    info["text"] = {"file": TEXT_ONNX, "inputs": [{"name": n, "dtype": "int64", "shape": ["batch", "length"]}
                                                  for n in ("input_ids", "attention_mask")], "output": output}
    if max(diff.values()) > ONNX_TOLERANCE:
        shown = ", ".join(f"{k} {v:.2g}" for k, v in diff.items())
        raise TrainError(f"the ONNX graphs do not reproduce the model (max abs difference {shown} > "
                         f"{ONNX_TOLERANCE:g}); export without --onnx")
    return {**info, "max_abs_diff": diff}


# --- README -----------------------------------------------------------------------------------------------------


def readme(meta: dict, out: Path) -> str:
    """README.md of the export: what the model is, what it was trained on, its eval numbers, how to load it."""
    config = meta["config"]
    source = meta["source"]
    pre = meta["preprocessing"]
    mc = meta["config"]["model"]
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
    size = pre["image_size"]
    stats = (f"RGB (transparency composited on white), the shorter side resized to {size} (antialiased bilinear on "
             f"uint8: config.json's preprocessing.resize_kernel), centre-cropped to {size} x {size}, scaled to "
             f"[0, 1] and normalised with mean {[round(v, 4) for v in pre['mean']]} and std "
             f"{[round(v, 4) for v in pre['std']]}: (batch, 3, {size}, {size}) float32"
             if pre["image_input"] == "pixels" else "")
    onnx = meta.get("onnx")
    if mc["image_model"] != "features":
        image_in = stats
    elif stats:
        image_in = (f"{stats}; the frozen `{meta['feature_encoder']['encoder']}` encoder turns them into the tokens "
                    "`vlprep features` caches" + (", and the pixels graph holds that encoder" if onnx else ""))
    else:
        image_in = ("the cached `vlprep features` tokens only (the export has no record of their encoder, so the "
                    "ONNX image graph reads tokens)")
    lines += ["## Files", "",
              "- `model.safetensors`: the weights inference reads (no optimiser, RNG, momentum copy or queues)",
              "- `config.json`: format, the run's config, preprocessing, provenance, eval numbers",
              "- `tokenizer/`: the Hugging Face tokenizer (`AutoTokenizer.from_pretrained`, or `tokenizers` "
              f"with tokenizer.json), captions padded to the longest and truncated to {pre['max_len']} tokens, the "
              f"length the model was trained and is evaluated with{max_length_note(pre)}"]
    if onnx and onnx.get("itc_trained") is False:
        lines += [f"- note: {UNTRAINED_ITC}; use `vltrain.load` and the aligner, not the ONNX graphs"]
    for key in ("image", "image_tokens") if onnx else ():
        if key in onnx:
            graph = onnx[key]["input"]
            lines.append(f"- `{onnx[key]['file']}`: `{graph['name']}` float32 ({', '.join(map(str, graph['shape']))})"
                         f" -> `embedding` (batch, {mc['embed_dim']}), L2-normalised")
    if onnx:
        lines.append(f"- `{TEXT_ONNX}`: `input_ids`, `attention_mask` int64 (batch, length) -> `embedding` "
                     f"(batch, {mc['embed_dim']}), L2-normalised")
    lines += ["", f"Images: {image_in}.", "", "## Loading", "", "```python", "import vltrain", "",
              f'model = vltrain.load("{out.name}")  # json and safetensors only: no pickle',
              'img = model.encode_images(["a.png"])', 'txt = model.encode_texts(["a dog"])', "```", ""]
    return "\n".join(lines)
