"""Zero-shot while training: eval.zeroshot_folder scored at every held-out evaluation (metrics.jsonl, TensorBoard,
the trackers, the learning curve), the same numbers as `vltrain eval --zeroshot-folder` on the checkpoint, and
eval.best_by choosing what best.pt keeps."""

import json
import re
from dataclasses import replace

import matplotlib.pyplot
import pytest
import torch
import yaml
from typer.testing import CliRunner

from tests.conftest import colour_pairs, image_bytes
from vltrain.cli import app
from vltrain.config import Config, ConfigError, EvalConfig, to_dict, to_yaml, validate
from vltrain.evaluate import evaluate_checkpoint
from vltrain.figures import plot_learning_curve
from vltrain.resume import config_diff
from vltrain.tracking import metrics

TINY = ["model.text_model=tiny", "model.image_model=tiny", "model.embed_dim=16", "data.image_size=32",
        "data.workers=0", "data.max_len=12", "log_every=1", "optim.warmup_steps=2", "optim.lr=0.01",
        "data.val_frac=0.3", "eval_every=2", "ckpt_every=2"]
KEYS = ("zeroshot_top1", "zeroshot_top5", "zeroshot_mean_per_class")
STEPS = 4


def folder(root, classes=("red", "green", "blue", "cat"), per_class=3):
    """A class-per-folder benchmark: random images, one folder per class, and a templates.txt."""
    for c, name in enumerate(classes):
        (root / name).mkdir(parents=True)
        for i in range(per_class):
            (root / name / f"{i}.png").write_bytes(image_bytes(36, 36, seed=100 * c + i))
    (root / "templates.txt").write_text("a {} picture\na photo of a {}.\n")
    return root


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """The data, the benchmark and two runs of the same seed: without the folder, and with it choosing best.pt by
    zero-shot top-1."""
    tmp = tmp_path_factory.mktemp("zstrain")
    shards = colour_pairs(tmp, 24)
    root = folder(tmp / "bench")
    outs = {}
    for name, extra in (("plain", []), ("top1", [f"eval.zeroshot_folder={root}", "eval.best_by=zeroshot_top1"])):
        sets = [x for s in TINY + extra for x in ("--set", s)]
        outs[name] = tmp / name
        r = CliRunner().invoke(app, ["run", str(shards), "--out", str(outs[name]), "--batch-size", "4", "--steps",
                                     str(STEPS), "--device", "cpu", "--preset", "clip", *sets])
        assert r.exit_code == 0, r.output + repr(r.exception)
        outs[name + "_output"] = r.output
    return {"shards": shards, "root": root, **outs}


def rows(out):
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def evals(out):
    return {r["step"]: r["val"] for r in rows(out) if "val" in r}


@pytest.mark.slow  # two tiny runs of 4 steps (about 15 s on 2 busy cores), shared
def test_every_evaluation_scores_the_folder_and_reports_it(world):
    ev = evals(world["top1"])
    assert sorted(ev) == list(range(2, STEPS + 1, 2))
    for v in ev.values():
        assert set(KEYS) <= set(v) and "mean_recall" in v  # held-out retrieval and zero-shot in one eval row
        assert (v["zeroshot_images"], v["zeroshot_classes"]) == (12, 4)
        assert 0 <= v["zeroshot_top1"] <= v["zeroshot_top5"] <= 100
        assert v["zeroshot_top5"] == 100.0  # 4 classes: every true class is among the 5 best
        assert v["zeroshot_chance"]["top1"] == 25.0
    assert all("zeroshot_top1" not in v for v in evals(world["plain"]).values())
    assert "zero-shot on 12 images of 4 classes" in world["top1_output"]
    assert f"(by zeroshot_top1; zero-shot on {world['root']})" in world["top1_output"]  # the start-up block
    # the trackers get each as val/KEY, TensorBoard the same tags
    last = [r for r in rows(world["top1"]) if "val" in r][-1]
    assert {f"val/{k}" for k in KEYS} <= set(metrics(last))
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tb = EventAccumulator(str(world["top1"] / "tb"))
    tb.Reload()
    for k in KEYS:
        scalars = tb.Scalars(f"val/{k}")
        assert [s.step for s in scalars] == sorted(ev)
        assert [s.value for s in scalars] == pytest.approx([ev[s][k] for s in sorted(ev)])
    result = json.loads((world["top1"] / "result.json").read_text())
    assert result["eval"]["zeroshot_top1"] == ev[STEPS]["zeroshot_top1"]


@pytest.mark.slow  # two tiny runs of 4 steps (about 15 s on 2 busy cores), shared
def test_the_numbers_are_vltrain_evals_on_the_same_checkpoint(world):
    final = evals(world["top1"])[STEPS]  # last.pt holds the final step's weights
    zs = evaluate_checkpoint(world["top1"] / "last.pt", zeroshot_folder=world["root"], device="cpu")["zeroshot"]
    assert zs["templates"] == ["a {} picture", "a photo of a {}."]
    assert [final[k] for k in KEYS] == [zs["top1"], zs["top5"], zs["mean_per_class"]]
    # and through the command line, as a user checks it
    r = CliRunner().invoke(app, ["eval", str(world["top1"] / "last.pt"), "--zeroshot-folder", str(world["root"]),
                                 "--device", "cpu", "--out", str(world["top1"] / "zs.json")])
    assert r.exit_code == 0, r.output
    cli = json.loads((world["top1"] / "zs.json").read_text())["zeroshot"]
    assert [final[k] for k in KEYS] == [cli["top1"], cli["top5"], cli["mean_per_class"]]


@pytest.mark.slow  # two tiny runs of 4 steps (about 15 s on 2 busy cores), shared
def test_scoring_the_folder_leaves_training_unchanged(world):
    def train_rows(out):  # every training row's losses, lr and counts; samples_per_s is a wall-clock rate
        return [{k: v for k, v in r.items() if k != "samples_per_s"} for r in rows(out) if "total" in r]

    plain, scored = train_rows(world["plain"]), train_rows(world["top1"])
    assert len(plain) == STEPS and plain == scored  # exact: the same float32 arithmetic, the same RNG draws
    a = torch.load(world["plain"] / "last.pt", weights_only=False)
    b = torch.load(world["top1"] / "last.pt", weights_only=False)
    assert all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])
    assert torch.equal(a["rng"]["torch"], b["rng"]["torch"])  # the global stream too: a resume goes on alike


@pytest.mark.slow  # two tiny runs of 4 steps (about 15 s on 2 busy cores), shared
def test_best_by_follows_the_chosen_score(world):
    ev = evals(world["top1"])
    steps = sorted(ev)
    assert len(steps) == 2 and all("mean_recall" in ev[s] for s in steps)
    top1 = [ev[s]["zeroshot_top1"] for s in steps]
    want = steps[top1.index(max(top1))]  # the first evaluation reaching the maximum: a later tie does not replace it
    best = torch.load(world["top1"] / "best.pt", weights_only=False)
    assert best["step"] == want and best["best"] == max(top1)
    # best.pt scored by `vltrain eval` gives the top-1 it was kept for
    zs = evaluate_checkpoint(world["top1"] / "best.pt", zeroshot_folder=world["root"], device="cpu")["zeroshot"]
    assert [ev[want][k] for k in KEYS] == [zs["top1"], zs["top5"], zs["mean_per_class"]]
    result = json.loads((world["top1"] / "result.json").read_text())
    assert (result["best_by"], result["best"], result["best_mean_recall"]) == ("zeroshot_top1", max(top1), None)
    # the default keeps the best held-out mean recall, as before
    mr = evals(world["plain"])
    recall = [mr[s]["mean_recall"] for s in steps]
    best = torch.load(world["plain"] / "best.pt", weights_only=False)
    assert best["step"] == steps[recall.index(max(recall))] and best["best"] == max(recall)
    result = json.loads((world["plain"] / "result.json").read_text())
    assert (result["best_by"], result["best"], result["best_mean_recall"]) == ("mean_recall", max(recall),
                                                                               max(recall))


def test_a_bad_benchmark_stops_the_run_before_training(tmp_path):
    shards = colour_pairs(tmp_path, 4)
    (tmp_path / "one" / "cat").mkdir(parents=True)
    (tmp_path / "one" / "cat" / "0.png").write_bytes(image_bytes(seed=1))
    for value, message in ((tmp_path / "missing", "eval.zeroshot_folder: zero-shot folder not found"),
                           (tmp_path / "one", "eval.zeroshot_folder: .* needs at least 2 class folders")):
        out = tmp_path / "run"
        sets = [x for s in TINY + [f"eval.zeroshot_folder={value}"] for x in ("--set", s)]
        r = CliRunner().invoke(app, ["run", str(shards), "--out", str(out), "--batch-size", "4",
                                     "--steps", "2", "--device", "cpu", "--preset", "clip", *sets])
        assert r.exit_code != 0
        lines = [line for line in r.output.splitlines() if line.strip()]
        assert len(lines) == 1 and re.search(message, lines[0]), r.output
        assert not (out / "metrics.jsonl").exists()


def test_eval_keys_are_checked_in_one_line(tmp_path):
    root = folder(tmp_path / "zs")
    ok = Config(shards=["x"], eval=EvalConfig(zeroshot_folder=str(root), best_by="zeroshot_top1"))
    validate(ok)
    assert yaml.safe_load(to_yaml(ok))["eval"] == {"zeroshot_folder": str(root), "zeroshot_templates": "",
                                                   "best_by": "zeroshot_top1"}  # what `vltrain config` prints
    (tmp_path / "bad.txt").write_text("no placeholder\n")
    for ev, message in (
            (EvalConfig(best_by="zeroshot_top1"), "eval.best_by=zeroshot_top1 needs eval.zeroshot_folder"),
            (EvalConfig(best_by="top5"), "unknown eval.best_by 'top5'; use one of mean_recall, zeroshot_top1"),
            (EvalConfig(zeroshot_templates=str(tmp_path / "bad.txt")), "eval.zeroshot_templates needs eval"),
            (EvalConfig(zeroshot_folder=str(root), zeroshot_templates=str(tmp_path / "bad.txt")),
             "eval.zeroshot_templates: .*has no {} for the class name"),
            (EvalConfig(zeroshot_folder="s3://bucket/imagenet"), "eval.zeroshot_folder")):
        with pytest.raises(ConfigError, match=message) as e:
            validate(Config(shards=["x"], eval=ev))
        assert "\n" not in str(e.value)
    with pytest.raises(ConfigError, match="TOnICS aligner"):
        validate(replace(ok, data=replace(ok.data, triplets=True), loss=replace(ok.loss, tonics_ir=1.0),
                         model=replace(ok.model, aligner=True), eval=EvalConfig(zeroshot_folder=str(root))))


def test_a_resume_may_change_the_benchmark_but_not_best_by(tmp_path):
    saved = to_dict(Config())
    assert config_diff(saved, to_dict(Config(eval=EvalConfig(zeroshot_folder="zs", zeroshot_templates="t")))) == []
    assert config_diff(saved, to_dict(Config(eval=EvalConfig(zeroshot_folder="zs", best_by="zeroshot_top1")))) == [
        "eval.best_by: 'mean_recall' -> 'zeroshot_top1'"]
    older = {k: v for k, v in saved.items() if k != "eval"}  # a checkpoint from before the section
    assert config_diff(older, to_dict(Config()), defaults=saved) == []


def test_the_learning_curve_draws_zero_shot_top1(tmp_path, monkeypatch):
    drawn = []
    real_close = matplotlib.pyplot.close
    monkeypatch.setattr(matplotlib.pyplot, "close", drawn.append)
    zs = {"zeroshot_top1": 30.0, "zeroshot_top5": 90.0, "zeroshot_mean_per_class": 29.0, "zeroshot_images": 12,
          "zeroshot_classes": 4, "zeroshot_chance": {"top1": 25.0}}
    retrieval = {"i2t_r1": 10.0, "t2i_r1": 20.0, "n_val": 8, "chance": {"i2t_r1": 12.5}}
    history = [{"step": 1, "total": 3.0}, {"step": 2, "val": {**retrieval, **zs}},
               {"step": 4, "val": {**retrieval, **zs, "zeroshot_top1": 50.0}}]
    plot_learning_curve(history, tmp_path / "a.png")
    lines = {line.get_label(): line for line in drawn[0].axes[1].get_lines()}
    assert list(lines["zero-shot top-1 (4 classes)"].get_xdata()) == [2, 4]
    assert list(lines["zero-shot top-1 (4 classes)"].get_ydata()) == [30.0, 50.0]
    assert list(lines["zero-shot chance (25.0%)"].get_ydata()) == [25.0, 25.0]
    assert "image→text R@1" in lines
    # a run without a held-out split scores zero-shot alone
    plot_learning_curve([{"step": 2, "val": zs}], tmp_path / "b.png")
    assert set(lines) - {l.get_label() for l in drawn[1].axes[1].get_lines()} >= {"image→text R@1"}
    assert (tmp_path / "a.png").stat().st_size and (tmp_path / "b.png").stat().st_size
    for fig in drawn:
        real_close(fig)


def test_a_run_inside_its_benchmark_is_refused_before_anything_is_written(tmp_path):
    # OUT inside ROOT/CLASS/ would put learning_curve.png among that class's images, and OUT = ROOT would make the run
    # folder's figures a class of their own: one line naming both, nothing created.
    shards = colour_pairs(tmp_path, 4)
    root = folder(tmp_path / "zs")
    for out, where in ((root / "cat" / "run", "lies inside"), (root, "is")):
        sets = [x for s in TINY + [f"eval.zeroshot_folder={root}"] for x in ("--set", s)]
        before = sorted(p.relative_to(root) for p in root.rglob("*"))
        r = CliRunner().invoke(app, ["run", str(shards), "--out", str(out), "--batch-size", "4", "--steps", "2",
                                     "--device", "cpu", "--preset", "clip", *sets])
        lines = [line for line in r.output.splitlines() if line.strip()]
        assert r.exit_code != 0 and len(lines) == 1, r.output
        assert f"OUT {out} {where} the zero-shot benchmark eval.zeroshot_folder {root}" in lines[0], lines[0]
        assert sorted(p.relative_to(root) for p in root.rglob("*")) == before
