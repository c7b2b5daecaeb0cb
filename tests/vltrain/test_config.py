import functools
import os
import re
from pathlib import Path

import pytest

from vltrain.config import PRESETS, Config, ConfigError, grit_sizes, to_dict
from vltrain.config_load import apply_overrides, from_dict, load_config, parse_set


def test_presets_set_what_the_papers_say():
    clip = load_config("clip")
    assert (clip.model.fusion_layers, clip.loss.itm, clip.loss.mlm, clip.model.momentum) == (0, 0.0, 0.0, False)
    albef = load_config("albef")
    assert albef.model.momentum and albef.model.queue_size > 0 and albef.loss.distill_alpha == 0.4
    assert albef.loss.mlm_prob == 0.15 and albef.loss.itm > 0 and albef.loss.mlm > 0
    base = load_config("albef-base")
    assert not base.model.momentum and base.loss.distill_alpha == 0.0 and base.model.queue_size == 0
    grit = load_config("grit")  # GRIT-VLP: ALBEFBase50 + GRIT + consistency 0.2
    assert (grit.sampler.kind, grit.loss.consistency, grit.loss.mlm_prob, grit.model.momentum) == ("grit", 0.2, 0.5,
                                                                                                   False)
    assert grit.loss.itm > 0 and grit.model.queue_size == 0
    assert grit.loss.itm_negatives == "hardest" and albef.loss.itm_negatives == base.loss.itm_negatives == "sample"
    assert grit.loss.itc_detach_keys and not base.loss.itc_detach_keys and not clip.loss.itc_detach_keys
    # ALBEF / ALBEFBase / GRIT split one BERT into text and fusion halves (BERT-base 6 + 6, MiniLM-L6 3 + 3)
    for c in (albef, base, grit):
        assert (c.model.fusion_from, c.model.fusion_layers) == ("split", 3)
    assert clip.model.fusion_from == "copy"  # unchanged: no fusion encoder at all
    assert not any(load_config(p).model.freeze_image for p in ("clip", "albef", "albef-base", "grit"))
    assert all(load_config(p).loss.dedupe == "none" for p in PRESETS)  # opt-in: no paper deduplicates
    for name, tr in (("tonics", 1.0), ("tonics-ir", 0.0)):
        t = load_config(name)
        assert (t.sampler.kind, t.data.triplets, t.model.aligner, t.loss.tonics_ir, t.loss.tonics_tr) == (
            "tonics", True, True, 1.0, tr)
        assert t.loss.itc == t.loss.itm == t.loss.mlm == 0.0
        assert t.model.freeze_image  # the paper's VinVL region features are frozen
        assert (t.sampler.alpha, t.sampler.beta, t.sampler.threshold, t.sampler.heldout) == (0.9, 0.2, 0.9, 100)
    assert set(PRESETS) == {"clip", "fistful", "albef", "albef-base", "tonics", "tonics-ir", "grit", "softmask"}
    sm = load_config("softmask")  # SoftMask++ 4: albef's model, focal ITC, soft ITM, masked text, MMDA, no distillation
    assert (sm.loss.focal_gamma, sm.loss.distill_alpha, sm.loss.itm, sm.loss.softmask_itm, sm.loss.mlm,
            sm.loss.mlm_prob) == (2.0, 0.0, 1.0, 1.0, 1.0, 0.15)
    assert (sm.loss.softmask_source, sm.loss.masked_text_all, sm.data.augment) == ("gradcam", True, "softmask")
    assert (sm.model.fusion_from, sm.model.fusion_layers, sm.model.momentum) == ("split", 3, True)
    assert albef.data.augment == "albef" and clip.data.augment == "none" and not albef.loss.masked_text_all
    fist = load_config("fistful")  # A Fistful of Words 3: dual encoder, EMA keys in an 8,192 bank, fixed tau 0.02
    assert (fist.model.fusion_layers, fist.model.momentum, fist.model.queue_size) == (0, True, 8192)
    assert (fist.model.temp, fist.model.temp_learnable, fist.model.pooling) == (0.02, False, "mean")
    assert fist.loss.itc == 1.0 and fist.loss.itm == fist.loss.mlm == fist.loss.distill_alpha == 0.0
    assert (clip.model.temp, clip.model.temp_learnable, clip.model.pooling) == (0.07, True, "cls")  # unchanged


def test_grit_sizes_default_to_the_papers_ratios():
    cfg = load_config("grit", batch_size=96)
    assert grit_sizes(cfg) == (960, 48000)  # GRIT-VLP 5.1: N = 96, M = 960 = 10 N, L = 48,000 = 50 M
    assert grit_sizes(load_config("grit", batch_size=32)) == (320, 16000)
    assert grit_sizes(load_config("grit", batch_size=128), (15, 25)) == (1920, 48000)  # the former ratios (Table 3)
    cfg = load_config("grit", sets=["sampler.search_space=100", "sampler.queue_size=400"])
    assert grit_sizes(cfg) == (100, 400)
    with pytest.raises(ConfigError, match="queue_size >= sampler.search_space"):
        load_config("grit", sets=["sampler.search_space=100", "sampler.queue_size=50"])
    with pytest.raises(ConfigError, match="need model.aligner=true and data.triplets=true"):
        load_config("albef", sets=["loss.tonics_ir=1"])


def test_precedence_preset_file_set_flags(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("batch_size: 16\nloss: {mlm_prob: 0.5}\noptim:\n  lr: 3.0e-4\n")
    cfg = load_config("albef-base", f, ["loss.mlm_prob=0.4", "model.embed_dim=64", "optim.betas=[0.9, 0.98]"],
                      batch_size=8, steps=None)
    assert cfg.batch_size == 8 and cfg.loss.mlm_prob == 0.4 and cfg.optim.lr == 3e-4
    assert cfg.model.embed_dim == 64 and cfg.optim.betas == [0.9, 0.98] and cfg.steps == Config().steps


@pytest.mark.parametrize("sets,match", [
    (["loss.nope=1"], r"^unknown config key loss.nope; valid keys of loss: itc, itm, mlm"),
    (["bogus=1"], r"^unknown config key bogus; valid keys: shards, out, preset"),
    (["loss=3"], r"loss is a section; set one of its keys"),
    (["steps.x=3"], r"steps is not a section"),
    (["steps=abc"], r"steps: expected an integer, got 'abc'"),
    (["model.momentum=3"], r"model.momentum: expected true/false"),
    (["loss.itm"], r"--set expects key=value"),
    (["batch_size=1"], r"^batch_size=1 is outside its range \[2, inf\) \(contrastive and ITM losses need "
                       r"negatives\)$"),
    (["preset=clip", "loss.distill_alpha=0.4", "model.momentum=false"], r"distill_alpha > 0 needs model.momentum"),
    (["model.fusion_from=share"], r"^unknown model.fusion_from 'share'; use one of copy, split, new$"),
    (["model.fusion_layers=0"], r"^model.fusion_from=split needs model.fusion_layers >= 1"),
    (["loss.distill_warmup_steps=-2"], r"^loss.distill_warmup_steps=-2 is outside its range \[-1, inf\) \(steps; "
                                       r"-1 = one epoch"),
    (["model.pooling=max"], r"^unknown model.pooling 'max'; use one of cls, mean$"),
    (["model.temp=0.9"], r"^model.temp=0.9 is outside its range \[0.001, 0.5\] \(the ITC temperature's clamp\)$"),
    (["loss.dedupe=image"], r"^unknown loss.dedupe 'image'; use one of none, caption$"),
    (["loss.dedupe=caption", "loss.focal_gamma=2"], r"^loss.dedupe=caption needs plain or distilled ITC"),
    (["loss.itm_negatives=top1"], r"^unknown loss.itm_negatives 'top1'; use one of sample, hardest$"),
])
def test_bad_overrides_are_one_line_errors(sets, match):
    with pytest.raises(ConfigError, match=match) as e:
        load_config("albef", None, sets)
    assert "\n" not in str(e.value)


def test_bad_preset_and_file(tmp_path):
    with pytest.raises(ConfigError, match="unknown preset 'gritty'; presets: clip, albef, albef-base, tonics"):
        load_config("gritty")
    with pytest.raises(ConfigError, match="config file not found"):
        load_config("albef", tmp_path / "none.yaml")
    (tmp_path / "l.yaml").write_text("- 1\n")
    with pytest.raises(ConfigError, match="expected a mapping"):
        load_config("albef", tmp_path / "l.yaml")


def test_round_trip_through_a_checkpoint_dict():
    cfg = load_config("clip", None, ["model.embed_dim=48", "seed=3"])
    assert from_dict(to_dict(cfg)) == cfg
    assert parse_set(["a=1", "b=true", "c=null", "d=x y"]) == {"a": 1, "b": True, "c": None, "d": "x y"}
    c = Config()
    apply_overrides(c, {"loss": {"itc": 2}})
    assert c.loss.itc == 2.0 and isinstance(c.loss.itc, float)


# Keys added with the fidelity options; a checkpoint written before them has none of them.
NEW_KEYS = {"loss": ["itm_negatives", "itc_detach_keys", "distill_warmup_steps", "dedupe"],
            "model": ["fusion_from", "temp_learnable", "pooling"]}


def older(cfg_dict: dict) -> dict:
    """The config dict as a checkpoint from before the NEW_KEYS would hold it."""
    old = {k: dict(v) if isinstance(v, dict) else v for k, v in cfg_dict.items()}
    for section, keys in NEW_KEYS.items():
        for k in keys:
            del old[section][k]
    return old


def test_keys_absent_from_an_older_checkpoint_count_as_their_defaults():
    from vltrain.checkpoint import model_config
    from vltrain.resume import config_diff

    defaults = to_dict(Config())
    clip = to_dict(load_config("clip"))
    assert config_diff(older(clip), clip, defaults=defaults) == []  # clip kept every former behaviour
    grit = to_dict(load_config("grit"))
    diffs = config_diff(older(grit), grit, defaults=defaults)
    assert "loss.itm_negatives: 'sample' (absent from this older checkpoint) -> 'hardest'" in diffs
    assert "model.fusion_from: 'copy' (absent from this older checkpoint) -> 'split'" in diffs
    assert "loss.itc_detach_keys: None -> False" in config_diff(older(clip), clip)  # without defaults
    # An older checkpoint's model section still builds its model: missing keys take the former layout.
    assert model_config(older(clip)["model"], "x.pt").fusion_from == "copy"
    assert from_dict(older(clip)) == load_config("clip")


def test_every_preset_is_named_in_the_help_the_readme_and_training_md():
    from typer.testing import CliRunner

    from vltrain.cli import app
    from vltrain.config import PRESETS

    root = Path(__file__).parents[2]
    readme, training = (root / "README.md").read_text(), (root / "docs" / "TRAINING.md").read_text()
    shown = CliRunner().invoke(app, ["run", "--help"], env={"COLUMNS": "200"}).output
    for name in PRESETS:
        assert re.search(rf"\b{re.escape(name)}\b", " ".join(shown.split())), f"vltrain run --help: {name}"
        assert f"| `{name}` |" in training, f"docs/TRAINING.md preset table: {name}"
        assert re.search(rf"presets[^.]*\b{re.escape(name)}\b", " ".join(readme.split())), f"README: {name}"


def test_masked_text_all_is_a_loss_key_and_the_old_data_key_still_works(tmp_path, capsys):
    from dataclasses import fields

    from vltrain.resume import check_resumable
    from vltrain.config import DataConfig, LossConfig, to_dict
    from vltrain.config_load import upgrade

    assert "masked_text_all" in {f.name for f in fields(LossConfig)}
    assert "masked_text_all" not in {f.name for f in fields(DataConfig)}
    assert load_config("softmask").loss.masked_text_all and not load_config("albef").loss.masked_text_all
    # --set and a YAML file with the old key: the value lands under loss, with one note naming the new key
    assert load_config("albef", sets=["data.masked_text_all=true"]).loss.masked_text_all is True
    assert capsys.readouterr().err.count("note: data.masked_text_all is now loss.masked_text_all") == 1
    old_yaml = tmp_path / "old.yaml"
    old_yaml.write_text("data:\n  masked_text_all: true\n  max_len: 20\n")
    cfg = load_config("albef", config_file=old_yaml)
    assert cfg.loss.masked_text_all is True and cfg.data.max_len == 20
    # a checkpoint's config from before the move rebuilds the same Config, quietly, and resumes
    old = to_dict(load_config("softmask"))
    old["data"]["masked_text_all"] = old["loss"].pop("masked_text_all")
    capsys.readouterr()
    assert from_dict(old) == load_config("softmask")
    assert "masked_text_all" not in capsys.readouterr().err
    assert upgrade(old)["loss"]["masked_text_all"] is True and "masked_text_all" not in upgrade(old)["data"]
    check_resumable({"config": old, "data": "sig"}, load_config("softmask"), "sig", tmp_path / "last.pt")
    with pytest.raises(Exception, match="loss.masked_text_all: True -> False"):
        check_resumable({"config": old, "data": "sig"}, load_config("softmask", sets=["loss.masked_text_all=false"]),
                        "sig", tmp_path / "last.pt")


# --- bounded config errors -------------------------------------------------------------------------------------------


def alias_bomb(levels: int, key: str = "optim.lr") -> str:
    """Billion laughs: each level is 9 aliases of the one before, so `levels` levels stand for 9 ** levels values."""
    lines = ['l0: &l0 ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]']
    lines += [f"l{i}: &l{i} [{', '.join([f'*l{i - 1}'] * 9)}]" for i in range(1, levels + 1)]
    section, name = key.split(".")
    return "\n".join(lines) + f"\n{section}:\n  {name}: *l{levels}\n"


@pytest.mark.parametrize("key", ["optim.lr", "model.text_model"])
def test_a_yaml_alias_bomb_is_refused_before_it_expands(tmp_path, key):
    """Before: 6 levels under optim.lr gave a 4.3 MB "one-line" error (9 levels: MemoryError after 25 s at 2.3 GB);
    under model.text_model the 531,441 strings became the model name and `vltrain config` printed 5.8 MB."""
    f = tmp_path / "bomb.yaml"
    f.write_text(alias_bomb(6, key))
    with pytest.raises(ConfigError) as e:
        load_config("albef", f)
    assert str(e.value) == (f"{f}: refused: its aliases expand to more than 10,000 values (an alias bomb?); write "
                            "the values out")
    with pytest.raises(ConfigError, match=r"^--set optim.lr: refused: its aliases expand to more than 10,000"):
        load_config("albef", sets=["optim.lr=" + alias_bomb(6, key)])  # the whole document as one --set value
    # aliases within the budget still work, and a self-referencing alias is refused, not followed
    ok = tmp_path / "ok.yaml"
    ok.write_text("defaults: &d {itc: 0.5, itm: 0.5}\nloss: *d\n")
    with pytest.raises(ConfigError, match="unknown config key defaults"):
        load_config("albef", ok)
    ok.write_text("loss: &d {itc: 0.5, itm: 0.5}\n")
    assert load_config("albef", ok).loss.itm == 0.5
    (tmp_path / "loop.yaml").write_text("optim: &a {betas: *a}\n")
    with pytest.raises(ConfigError, match="refused: a recursive alias"):
        load_config("albef", tmp_path / "loop.yaml")


@pytest.mark.parametrize("sets,match", [
    (["model.text_model=[a, b]"], r"^model.text_model: expected a string, got \['a', 'b'\]$"),
    (["optim.lr={a: 1}"], r"^optim.lr: expected a number, got \{'a': 1\}$"),
    (["out=[x]"], r"^out: expected a string, got \['x'\]$"),
    (["model.feature_encoder=[1]"], r"^model.feature_encoder: expected a mapping, got \[1\]$"),
    (["optim.betas={a: 1}"], r"^optim.betas: expected a list, got \{'a': 1\}$"),
    (["train.tf32=[auto]"], r"^train.tf32: expected str or bool, got \['auto'\]$"),
])
def test_every_value_is_type_checked_against_its_field(sets, match):
    with pytest.raises(ConfigError, match=match):
        load_config("albef", sets=sets)


def test_error_messages_quote_at_most_80_characters_of_a_value():
    for sets in (["model.text_model=" + "[" + ", ".join(["x" * 50] * 1000) + "]"],
                 ["optim.lr=" + "y" * 100_000], ["data.input=" + "z" * 100_000], ["a" * 5000 + "=1"]):
        with pytest.raises(ConfigError) as e:
            load_config("albef", sets=sets)
        assert len(str(e.value)) < 300 and "\n" not in str(e.value) and "…" in str(e.value), str(e.value)[:400]


def test_numeric_keys_are_checked_against_the_ranges_table():
    """Before: model.embed_dim=0 trained with a constant loss of ln 8 and exited 0."""
    from vltrain.config import RANGES, in_range

    with pytest.raises(ConfigError, match=r"^model.embed_dim=0 is outside its range \[1, inf\) \(ITC projection "
                                          r"size\)$"):
        load_config("albef", sets=["model.embed_dim=0"])
    bad = {"steps": -1, "seed": -1, "model.feature_dim": 0, "model.momentum_m": 1.5, "model.queue_size": -1,
           "data.image_size": 100000, "data.max_len": 1, "data.min_crop_scale": 0, "loss.itm": -1,
           "loss.mlm_prob": 2, "loss.distill_alpha": 1.5, "sampler.threshold": 2, "optim.lr": -1e-4,
           "optim.lr ": ".nan", "optim.weight_decay": -0.1, "optim.min_lr_ratio": 2, "optim.grad_clip": -1,
           "optim.betas": "[0.9, 1.0]", "epochs": -1, "ckpt_minutes": 0, "data.val_frac": 1}
    for key, value in bad.items():
        with pytest.raises(ConfigError, match=rf"^{re.escape(key.strip())}=.* is outside its range [\[(]"):
            load_config("albef", sets=[f"{key.strip()}={value}"])
    with pytest.raises(ConfigError, match=r"^optim.betas: expected two numbers"):
        load_config("albef", sets=["optim.betas=[0.9]"])
    assert in_range(0, "[0, 1)") and not in_range(1, "[0, 1)") and not in_range(0, "(0, 1]")
    assert not in_range(float("nan"), "[0, inf)") and not in_range(float("inf"), "(0, inf)")
    for preset in PRESETS:  # every default and preset value is in range
        cfg = load_config(preset)
        for key, (interval, _) in RANGES.items():
            value = functools.reduce(getattr, key.split("."), cfg)
            assert all(in_range(v, interval) for v in (value if isinstance(value, list) else [value])), (preset, key)


def test_every_numeric_key_has_a_range_and_the_docs_list_them():
    from dataclasses import fields as dc_fields, is_dataclass

    from vltrain.config import RANGES

    def numeric(obj, prefix=""):
        for f in dc_fields(obj):
            value = getattr(obj, f.name)
            if is_dataclass(value):
                yield from numeric(value, f"{prefix}{f.name}.")
            elif (isinstance(value, (int, float)) and not isinstance(value, bool)) or f.name == "betas":
                yield prefix + f.name

    assert set(numeric(Config())) == set(RANGES)
    docs = " ".join((Path(__file__).parents[2] / "docs" / "TRAINING.md").read_text().split())
    for key, (interval, _) in RANGES.items():
        assert f"| `{key}` | `{interval}` |" in docs, key


def test_a_config_folder_or_unreadable_file_is_one_line(tmp_path):
    with pytest.raises(ConfigError, match=rf"^--config {re.escape(str(tmp_path))} is a folder; give a YAML file$"):
        load_config("albef", tmp_path)
    (tmp_path / "big.yaml").write_text("# x\n" * 400_000)
    with pytest.raises(ConfigError, match=r"big.yaml: 1,600,000 bytes; a config file is at most 1,048,576$"):
        load_config("albef", tmp_path / "big.yaml")
    (tmp_path / "bin.yaml").write_bytes(b"steps: \xff\xfe\n")
    with pytest.raises(ConfigError, match=r"bin.yaml: not UTF-8 text$"):
        load_config("albef", tmp_path / "bin.yaml")
    # the library call too (the CLI checked before it): a FIFO is never opened for a blocking read (which waited
    # forever for a writer), nor is /dev/zero read without end
    os.mkfifo(tmp_path / "fifo.yaml")
    with pytest.raises(ConfigError, match=r"fifo.yaml is not a regular file \(a FIFO\); give a YAML file$"):
        load_config("albef", tmp_path / "fifo.yaml")
    with pytest.raises(ConfigError, match=r"^--config /dev/zero is not a regular file \(a character device\)"):
        load_config("albef", Path("/dev/zero"))


@pytest.mark.parametrize("key", ["out", "model.text_model", "model.image_weights", "sampler.ontology"])
def test_a_url_in_a_path_key_is_refused(key):
    with pytest.raises(ConfigError, match=rf"^{key} s3://b/x: only dataset folders may be URLs \(s3://, gs://, "
                                          r"http\(s\)://\); give a local path$"):
        load_config("albef", sets=[f"{key}=s3://b/x"])
    assert load_config("albef", sets=["out=C:/runs/x"]).out == "C:/runs/x"  # a drive letter is not a scheme


def test_shards_may_be_urls_of_a_scheme_we_read_and_only_for_the_streaming_sampler():
    """Nothing is contacted here: the config is only validated."""
    assert load_config("clip", sets=["shards=[s3://b/x, 'http://127.0.0.1:1/ds/']"]).shards == [
        "s3://b/x", "http://127.0.0.1:1/ds/"]
    with pytest.raises(ConfigError, match=r"^shards ftp://b/x: unsupported URL scheme ftp://; use s3://, gs://, "
                                          r"http\(s\):// or file://$"):
        load_config("clip", sets=["shards=[ftp://b/x]"])
    with pytest.raises(ConfigError, match=r"^sampler.kind=grit reads samples by index \(random access\), which needs "
                                          "local shards, and gs://b/x is a URL"):
        load_config("grit", sets=["shards=[gs://b/x]"])
