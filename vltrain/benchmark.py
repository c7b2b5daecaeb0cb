"""CLIP_benchmark (the `clip_benchmark` package) scoring vltrain models: its model loader and `vltrain benchmark`.

CLIP_benchmark reads models through `clip_benchmark.models.TYPE2FUNC`, a dict in its source (model type -> loader
`(model_name, pretrained, cache_dir, device) -> (model, transform, tokenizer)`), and its `--model_type` accepts the
keys of `MODEL_TYPES` as they are when its command line parses. It has no plug-in entry point, so `registered()`
adds "vltrain" to both for the duration of a call and takes it out after: importing this module changes nothing.

    vltrain benchmark runs/x/best.pt --dataset wds/NAME --dataset-root ROOT --task zeroshot_classification
    python -m vltrain.benchmark eval --model_type vltrain --model vltrain --pretrained runs/x/best.pt --dataset ...

The first runs CLIP_benchmark's own evaluation (`clip_benchmark.cli.main_eval`, on arguments from its own parser)
for one dataset and task; the second is CLIP_benchmark's whole command line with the loader registered. The model
object has the two calls CLIP_benchmark's metrics make, `encode_image` and `encode_text`, computed as
`vltrain.Model.encode_images` / `encode_texts` compute them (same preprocessing, tokenizer and precision).
docs/EVALUATION.md says when to use this and when `vltrain eval`.
"""

import contextlib
import gc
import json
import sys
import tempfile
from pathlib import Path
from unittest import mock

import torch
import torch.nn.functional as F

from vlprep.urls import redact
from vltrain.api import load, to_pil
from vltrain.errors import TrainError
from vltrain.fetchckpt import is_url, local_checkpoint, result_url, upload_result
from vltrain.losses import upcast
from vltrain.model import autocast

NAME = "vltrain"
TASKS = ("zeroshot_classification", "zeroshot_retrieval", "linear_probe")
RECALL_K = (1, 5, 10)


class Pixels:
    """A PIL image from CLIP_benchmark's dataset -> (3, S, S) float32 by the model's eval transform, as
    vltrain.Model.pixels makes it (RGB, transparency on white); a plain object so loader workers can pickle it."""

    def __init__(self, transform):
        self.transform = transform

    def __call__(self, image) -> torch.Tensor:
        return self.transform(to_pil(image)).as_subclass(torch.Tensor)


class Tokens:
    """Texts -> (B, 2, L) int64, the input ids and the attention mask stacked on dim 1: CLIP_benchmark hands one
    tensor from its tokenizer to encode_text, and the mask cannot be read back from the ids (a CLIP tokenizer pads
    with its end-of-text id)."""

    def __init__(self, model):
        self.model = model

    def __call__(self, texts) -> torch.Tensor:
        tok = self.model.tokens(list(texts))
        return torch.stack([tok["input_ids"], tok["attention_mask"]], dim=1).cpu()


class ClipLike(torch.nn.Module):
    """A vltrain network with CLIP_benchmark's calls: encode_image (B, 3, S, S) and encode_text (B, 2, L) from
    Tokens, each -> (B, E) float32 L2-normalised ITC embeddings on the network's device."""

    def __init__(self, net):
        super().__init__()
        self.net = net

    def _precision(self, device: torch.device):
        # CLIP_benchmark wraps these calls in its own autocast (fp16 on CUDA, bf16 on a CPU with --amp): switched
        # off, then vltrain's inference precision (bf16 on CUDA, float32 on a CPU), so the embeddings are
        # vltrain.Model's whatever CLIP_benchmark's --amp says
        stack = contextlib.ExitStack()
        stack.enter_context(torch.no_grad())
        stack.enter_context(torch.autocast(device.type, enabled=False))
        stack.enter_context(autocast(device))
        return stack

    def _device(self, x: torch.Tensor) -> torch.device:
        # a DataParallel replica (CLIP_benchmark's linear probe makes them) lists no parameters; its input is on its
        # device
        param = next(self.net.parameters(), None)
        return x.device if param is None else param.device

    def encode_image(self, images: torch.Tensor) -> torch.Tensor:
        device = self._device(images)
        with self._precision(device):
            _, emb = self.net.encode_image(images.to(device))
        return F.normalize(upcast(emb).float(), dim=-1)

    def encode_text(self, tokens: torch.Tensor) -> torch.Tensor:
        device = self._device(tokens)
        tokens = tokens.to(device)
        with self._precision(device):
            _, emb = self.net.encode_text(tokens[:, 0], tokens[:, 1])
        return F.normalize(upcast(emb).float(), dim=-1)


def for_clip_benchmark(model) -> tuple:
    """A loaded vltrain.Model as CLIP_benchmark's (model, transform, tokenizer)."""
    if model.transform is None:
        model.pixels([])  # its one-line ValueError: a cached-token model without an encoder record reads no pixels
    return ClipLike(model.net).eval(), Pixels(model.transform), Tokens(model)


def load_vltrain(model_name: str = NAME, pretrained: str = "", cache_dir=None, device="cpu") -> tuple:
    """CLIP_benchmark's loader: `pretrained` is a vltrain checkpoint or export; model_name and cache_dir are unused."""
    return for_clip_benchmark(load(pretrained, device=str(device)))


def accuracy(output: torch.Tensor, target: torch.Tensor, topk=(1,)) -> list[float]:
    """clip_benchmark.metrics.zeroshot_classification.accuracy, the same arithmetic (top-k hits / N for each k,
    output (N, C), target (N,)) with `.item()` where 1.6.2 calls float() on a one-element array, which NumPy >= 2.4
    refuses."""
    pred = output.topk(max(topk), 1, True, True)[1].t()
    correct = pred.eq(target.view(1, -1).expand_as(pred))
    return [correct[:k].reshape(-1).float().sum().item() / len(target) for k in topk]


def _accuracy_works(zeroshot) -> bool:
    """Whether CLIP_benchmark's own accuracy runs under the installed NumPy."""
    try:
        zeroshot.accuracy(torch.zeros(1, 2), torch.zeros(1, dtype=torch.long))
    except TypeError:
        return False
    return True


@contextlib.contextmanager
def registered(loader=load_vltrain):
    """CLIP_benchmark's model registry with "vltrain" -> `loader` inside the block, and as it was after; where its
    `accuracy` fails under this NumPy, `accuracy` above stands in for it inside the block."""
    from clip_benchmark import models
    from clip_benchmark.metrics import linear_probe, zeroshot_classification

    before = dict(models.TYPE2FUNC)
    types = list(models.MODEL_TYPES)
    functions = [(m, m.accuracy) for m in (zeroshot_classification, linear_probe)]
    models.TYPE2FUNC[NAME] = loader
    if NAME not in models.MODEL_TYPES:  # in place: clip_benchmark.cli imported this very list
        models.MODEL_TYPES.append(NAME)
    if not _accuracy_works(zeroshot_classification):
        for module, _ in functions:  # linear_probe imported the name: both hold it
            module.accuracy = accuracy
    try:
        yield
    finally:
        models.TYPE2FUNC.clear()
        models.TYPE2FUNC.update(before)
        models.MODEL_TYPES[:] = types
        for module, function in functions:
            module.accuracy = function


def clip_benchmark_cli():
    """clip_benchmark.cli, or a one-line TrainError saying what to install."""
    try:
        import clip_benchmark.cli
    except ImportError as e:
        raise TrainError(f"CLIP_benchmark cannot be imported (missing: {e.name or e}); pip install "
                         "'clip_benchmark>=1.6' (the [benchmark] extra)") from None
    return clip_benchmark.cli


def parse(cli, argv: list[str]):
    """CLIP_benchmark's own parser over `argv`: every option it has, with its defaults (it reads sys.argv only)."""
    with mock.patch.object(sys, "argv", ["clip_benchmark", *argv]):
        return cli.get_parser_args()[1]


def resolve_task(dataset: str, task: str) -> str:
    """--task as given, or for "auto" the task CLIP_benchmark infers from the dataset name; one of TASKS."""
    from clip_benchmark.datasets.builder import dataset_collection, get_dataset_default_task

    if dataset in dataset_collection or Path(dataset).is_file():
        raise TrainError(f"--dataset {dataset!r} names several datasets; `vltrain benchmark` runs one (loop over "
                         "them, or use `python -m vltrain.benchmark eval`, CLIP_benchmark's own command line)")
    if task == "auto":
        task = get_dataset_default_task(dataset.removeprefix("wds/"))
    if task not in TASKS:
        raise TrainError(f"task {task!r} is not one of {', '.join(TASKS)} (or auto)")
    if task == "linear_probe" and not torch.cuda.is_available():
        raise TrainError("CLIP_benchmark's linear probe runs on CUDA only (its own check) and this machine has none")
    return task


def run(checkpoint, dataset: str, root: str, task: str = "auto", out=None, split: str = "test",
        batch_size: int = 64, workers: int = 4, recall_k=RECALL_K) -> dict:
    """One CLIP_benchmark evaluation of a vltrain checkpoint or export (or the URL of a checkpoint file); its result
    JSON, also written to `out` (default: beside the checkpoint, inside an export). Metrics are CLIP_benchmark's, as
    fractions."""
    cli = clip_benchmark_cli()
    if batch_size < 1 or workers < 0 or not recall_k or min(recall_k) < 1:
        raise TrainError(f"--batch-size must be >= 1, --num-workers >= 0 and each --recall-k >= 1, got {batch_size}, "
                         f"{workers} and {list(recall_k)}")
    task = resolve_task(dataset, task)
    if is_url(checkpoint):
        return _run_url(checkpoint, dataset, root, task, out, split, batch_size, workers, recall_k)
    checkpoint = Path(checkpoint)
    if out is None:
        folder = checkpoint if checkpoint.is_dir() else checkpoint.parent
        out = folder / f"benchmark_{dataset.replace('/', '_')}_{task}.json"
    out = Path(out)
    model = load(checkpoint)  # before CLIP_benchmark starts: a file that is not a model is our one-line error
    workers = _workers(dataset, root, split, workers)
    before = _folders(root)  # a download creates ROOT (and folders in it); a failed one must not leave them empty
    # a fresh feature cache: the linear probe reuses any cache it finds under the model's name, which a checkpoint
    # retrained at the same path keeps
    with tempfile.TemporaryDirectory(prefix="vltrain-benchmark-") as features, \
            registered(lambda **_: for_clip_benchmark(model)):
        args = parse(cli, ["eval", "--model_type", NAME, "--model", NAME, "--pretrained", str(checkpoint),
                           "--dataset", dataset, "--dataset_root", _literal(root), "--task", task, "--split", split,
                           "--batch_size", str(batch_size), "--num_workers", str(workers),
                           "--recall_k", *map(str, recall_k), "--no_amp", "--quiet", "--feature_root", features,
                           "--output", _literal(out)])
        failure = None
        try:
            cli.main_eval(args)
        except (AssertionError, ValueError, OSError) as e:  # its checks of dataset, split and files
            # the last line: a loader worker's error arrives with the worker's traceback above it
            failure = ([line.strip() for line in str(e).splitlines() if line.strip()] or [type(e).__name__])[-1]
        if failure is not None:
            # the failed loop's frames hold its DataLoader iterator in a reference cycle: collected now, it shuts its
            # worker processes down before this returns rather than at some later collection
            gc.collect()
            _remove_empty(root, before)
            raise TrainError(f"CLIP_benchmark on {dataset} ({task}): {failure}")
    return json.loads(out.read_text())


def _run_url(url: str, dataset: str, root: str, task: str, out, split: str, batch_size: int, workers: int,
             recall_k) -> dict:
    """`run` of the checkpoint file at `url`, downloaded once and removed after (vltrain.fetchckpt); the result's
    "pretrained" is the URL redacted; without `out` it is uploaded beside the checkpoint (s3://, gs://)."""
    name = f"benchmark_{dataset.replace('/', '_')}_{task}.json"
    target = None if out is not None else result_url(url, name, "--output")
    with local_checkpoint(url) as local:
        written = Path(out) if out is not None else local.with_name(name)
        result = run(local, dataset, root, task, written, split, batch_size, workers, recall_k)
        result["pretrained"] = redact(url)
        written.write_text(json.dumps(result))
        if target is not None:
            upload_result(written, target, "--output")
    return result


def _workers(dataset: str, root: str, split: str, workers: int) -> int:
    """--num-workers, at most the shard count of a local wds/ dataset (webdataset stops a worker that gets none)."""
    counts = Path(root, split, "nshards.txt")
    if not dataset.startswith("wds/") or "://" in str(root) or not counts.is_file():
        return workers
    try:
        return max(0, min(workers, int(counts.read_text().strip())))
    except ValueError:  # CLIP_benchmark reads the file too and says what is wrong with it
        return workers


def _folders(root: str) -> set[Path] | None:
    """The folders that exist now on the way to a local ROOT, ROOT and those directly in it (None for a URL): what
    a run did not create."""
    if "://" in str(root):
        return None
    path = Path(root).absolute()
    found = {p for p in (path, *path.parents) if p.is_dir()}
    return found | ({p for p in path.iterdir() if p.is_dir()} if path.is_dir() else set())


def _remove_empty(root: str, before: set[Path] | None) -> None:
    """After a failed run: remove the folders it created (ROOT and the folders above it up to the first that was
    there, new folders in ROOT and everything under those) that it left empty, deepest first. Files, and the
    folders holding any, stay: a download that failed later, in the evaluation, keeps its data."""
    if before is None:
        return
    path = Path(root).absolute()
    made = [p for p in (path, *path.parents) if p not in before]
    for new in [p for p in path.iterdir() if p.is_dir() and p not in before] if path.is_dir() else []:
        made += [new, *(p for p in new.rglob("*") if p.is_dir())]
    for folder in sorted(made, key=lambda p: len(p.parts), reverse=True):
        try:
            folder.rmdir()  # only an empty folder goes
        except OSError:
            pass


def _literal(path) -> str:
    """A path as CLIP_benchmark's --output / --dataset_root take it: they are str.format templates, so braces double."""
    return str(path).replace("{", "{{").replace("}", "}}")


def main(argv: list[str] | None = None) -> int:
    """`python -m vltrain.benchmark ARGS`: CLIP_benchmark's command line (`eval`, `build`) with "vltrain" registered."""
    try:
        cli = clip_benchmark_cli()
    except TrainError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    with registered(), mock.patch.object(sys, "argv", ["clip_benchmark", *(sys.argv[1:] if argv is None else argv)]):
        cli.main()
    return 0


if __name__ == "__main__":
    sys.exit(main())
