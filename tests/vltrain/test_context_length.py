"""A CLIP or SigLIP start reads captions as its source model does: data.max_len defaults to the text tower's context
length (its positions: CLIP's 77, SigLIP's 64) unless the user set it, and every export writes the length the model
was trained with into its tokenizer's model_max_length, so transformers and open_clip cut a caption where
vltrain.load does. On tiny random towers built offline (tests.vltrain.tinyclip).

Captions are built from words CLIP's BPE keeps whole, so a caption of n words is n + 2 tokens (start and end), which
the test checks with the tokenizer untruncated.

Tolerances: the same transformers modules run the same float32 kernels on the same token ids, so the embeddings
agree to float32 rounding of unit vectors, 8 ulps of 1 (8 * 2**-23); open_clip's own text transformer (one fused
attention projection, its own LayerNorm calls) sums in another order: 1e-5, as tests/vltrain/test_open_clip_interop.py
bounds it. Different truncations differ by orders of magnitude more (checked: the test has teeth)."""

import json
import os

import pytest
import torch
import torch.nn.functional as F
import yaml
from typer.testing import CliRunner

from tests.conftest import colour_pairs
from tests.vltrain.test_init_from import ok
from tests.vltrain.tinyclip import SIGLIP_TEXT_LEN, tiny_clip, tiny_siglip
from vltrain.cli import app
from vltrain.config import Config
from vltrain.config_load import load_config, user_set
from vltrain.resolve import resolve_towers

ULPS = 8 * 2.0 ** -23
OPEN_CLIP_TOL = 1e-5
CONTEXT = 77  # tiny_clip's text positions, as OpenAI's CLIP has
WORDS = ["red", "dog", "on", "grass"]  # one BPE token each
BASE = ["--preset", "clip", "--steps", "1", "--batch-size", "8", "--device", "cpu", "--set", "data.workers=0",
        "--set", "optim.lr=0"]


def caption(tokens: int) -> str:
    """A caption CLIP's tokenizer encodes to exactly `tokens` ids (start and end included)."""
    return " ".join(WORDS[i % len(WORDS)] for i in range(tokens - 2))


LONG = [caption(n) for n in (33, 62, 77, 100)] + ["a red dog"]  # past 32, up to and past the context length


@pytest.fixture(scope="module")
def clip_dir(tmp_path_factory):
    return tiny_clip(tmp_path_factory.mktemp("clip") / "tiny-clip")


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    return colour_pairs(tmp_path_factory.mktemp("pairs"), 16)


@pytest.mark.slow
def test_captions_have_the_token_counts_they_are_built_with(clip_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(clip_dir))
    assert [len(tok(c)["input_ids"]) for c in LONG] == [33, 62, 77, 100, 5]


def test_the_loader_records_the_keys_the_user_gave(tmp_path):
    file = tmp_path / "c.yaml"
    file.write_text(yaml.safe_dump({"data": {"max_len": 32}, "model.embed_dim": 64}))
    cfg = load_config("albef", file, ["loss.itm=0.5"], steps=7, batch_size=None)
    assert all(user_set(cfg, k) for k in ("data.max_len", "model.embed_dim", "loss.itm", "steps"))
    assert not user_set(cfg, "batch_size")  # a flag left out (None)
    assert not user_set(cfg, "model.queue_size")  # the preset's value (4096), no user's choice
    assert not user_set(load_config("clip"), "data.max_len")
    built = Config()
    built.data.max_len = 40  # a config built in code: a value other than the default was chosen
    assert user_set(built, "data.max_len") and not user_set(Config(), "data.max_len")


@pytest.mark.slow  # a tiny CLIP and a tiny SigLIP folder built: about 10 s on 2 cores
def test_max_len_follows_the_tower_unless_the_user_set_it(clip_dir, tmp_path):
    spec = f"clip:{clip_dir}"
    towers = [f"model.text_model={spec}", f"model.image_model={spec}"]
    cfg, notes = resolve_towers(load_config("clip", None, towers))
    assert cfg.data.max_len == CONTEXT
    assert f"note: data.max_len {CONTEXT}: the CLIP tower's context length" in "\n".join(notes)
    for given in (32, 40, CONTEXT):  # 32 is the default's value, and still the user's choice when set
        cfg, notes = resolve_towers(load_config("clip", None, [*towers, f"data.max_len={given}"]))
        assert cfg.data.max_len == given and "context length" not in "\n".join(notes)
    cfg, notes = resolve_towers(load_config("clip", None, [*towers, "data.max_len=100"]))  # as before: lowered
    assert cfg.data.max_len == CONTEXT and f"note: data.max_len 100 -> {CONTEXT}" in "\n".join(notes)
    siglip = f"clip:{tiny_siglip(tmp_path / 'siglip')}"
    cfg, notes = resolve_towers(load_config("clip", None, [f"model.text_model={siglip}",
                                                           f"model.image_model={siglip}"]))
    assert cfg.data.max_len == SIGLIP_TEXT_LEN  # its positions (64 in Google's models)
    assert f"note: data.max_len {SIGLIP_TEXT_LEN}: the SigLIP tower's context length" in "\n".join(notes)
    out = CliRunner().invoke(app, ["config", "--preset", "clip", "--set", towers[0], "--set", towers[1]])
    assert yaml.safe_load(ok(out).stdout)["data"]["max_len"] == CONTEXT  # `vltrain config` shows what a run uses


def source_texts(clip_dir, texts, max_length: int) -> torch.Tensor:
    """The source CLIPModel's L2-normalised text embeddings, its tokenizer cutting at `max_length`."""
    from transformers import AutoProcessor, CLIPModel

    model = CLIPModel.from_pretrained(str(clip_dir)).eval()
    x = AutoProcessor.from_pretrained(str(clip_dir))(text=texts, padding="longest", truncation=True,
                                                     max_length=max_length, return_tensors="pt")
    with torch.no_grad():
        return F.normalize(model.get_text_features(input_ids=x.input_ids, attention_mask=x.attention_mask)
                           .pooler_output, dim=-1)


def train(pairs, out, clip_dir, *extra):
    r = ok(CliRunner().invoke(app, ["run", str(pairs), "--out", str(out), "--init-from", f"clip:{clip_dir}", *BASE,
                                    *extra]))
    return r.output


@pytest.fixture(scope="module")
def default_run(clip_dir, pairs, tmp_path_factory):
    out = tmp_path_factory.mktemp("runs") / "default"
    return out, train(pairs, out, clip_dir)


@pytest.mark.slow
def test_a_clip_start_embeds_long_captions_as_the_source_does(clip_dir, default_run):
    """Step 0 of a run from --init-from clip:PATH (lr 0: the weights stay the source's) embeds captions of 33-100
    tokens as the source CLIPModel with truncation=True at its context length; the old 32 would not."""
    import vltrain

    out, output = default_run
    assert f"data.max_len {CONTEXT}: the CLIP tower's context length" in output
    got = vltrain.load(out / "last.pt", device="cpu").encode_texts(LONG)
    want = source_texts(clip_dir, LONG, CONTEXT)
    assert torch.allclose(got, want, rtol=0, atol=ULPS)
    at_32 = source_texts(clip_dir, LONG, 32)
    assert (at_32[:4] - want[:4]).abs().max() > 1000 * ULPS  # cutting at 32 changes every long caption
    assert torch.allclose(at_32[4], want[4], rtol=0, atol=ULPS)  # a short one is cut nowhere


def hf_texts(export, texts) -> torch.Tensor:
    """transformers alone on an hf export: its processor's defaults (truncation=True, no max_length given)."""
    from transformers import AutoProcessor, CLIPModel

    model = CLIPModel.from_pretrained(str(export)).eval()
    x = AutoProcessor.from_pretrained(str(export))(text=texts, padding="longest", truncation=True,
                                                   return_tensors="pt")
    with torch.no_grad():
        return F.normalize(model.get_text_features(input_ids=x.input_ids, attention_mask=x.attention_mask)
                           .pooler_output, dim=-1)


def open_clip_texts(export, texts, max_len: int | None = None) -> torch.Tensor:
    """open_clip on an open_clip export, as its README says: the tokenizer's own context length, or cut at `max_len`
    and padded to the tower's positions."""
    before = os.environ.get("TOKENIZERS_PARALLELISM")
    import open_clip  # its tokenizer module sets TOKENIZERS_PARALLELISM: put the environment back as it was

    if before is None:
        os.environ.pop("TOKENIZERS_PARALLELISM", None)
    else:
        os.environ["TOKENIZERS_PARALLELISM"] = before
    model, _, _ = open_clip.create_model_and_transforms(f"local-dir:{export}")
    tokenizer = open_clip.get_tokenizer(f"local-dir:{export}")
    ids = tokenizer(texts) if max_len is None else F.pad(tokenizer(texts, context_length=max_len),
                                                         (0, CONTEXT - max_len))
    with torch.no_grad():
        return F.normalize(model.eval().encode_text(ids), dim=-1)


def exported(run_dir, folder, fmt):
    ok(CliRunner().invoke(app, ["export", str(run_dir / "last.pt"), str(folder), "--format", fmt]))
    return folder


@pytest.mark.slow
def test_every_export_truncates_as_vltrain_load_of_it(default_run, clip_dir, pairs, tmp_path):
    """hf, open_clip and vltrain exports of a default start (77) and of one with data.max_len=40: transformers and
    open_clip on the export embed long captions as vltrain.load of the same export does, and the READMEs say the
    length. The 77 exports are written after the 40 run tokenized its last batch: the shared tokenizer's stale
    truncation state must not reach the export's tokenizer.json (it cut the 77 export's captions at 40)."""
    import vltrain
    from transformers import AutoTokenizer

    short = tmp_path / "short"
    output = train(pairs, short, clip_dir, "--set", "data.max_len=40")
    assert "context length" not in output
    for run_dir, max_len in ((default_run[0], CONTEXT), (short, 40)):
        hf = exported(run_dir, tmp_path / f"hf-{max_len}", "hf")
        ours = vltrain.load(hf, device="cpu").encode_texts(LONG)
        theirs = hf_texts(hf, LONG)
        assert torch.allclose(theirs, ours, rtol=0, atol=ULPS), ((theirs - ours).abs().max(1), max_len)
        assert torch.allclose(ours, source_texts(clip_dir, LONG, max_len), rtol=0, atol=ULPS)  # lr 0: the source's
        assert json.loads((hf / "tokenizer_config.json").read_text())["model_max_length"] == max_len
        assert f"`model_max_length` {max_len}, the length the model was trained" in (hf / "README.md").read_text()

        oc = exported(run_dir, tmp_path / f"oc-{max_len}", "open_clip")
        got = open_clip_texts(oc, LONG, None if max_len == CONTEXT else max_len)
        assert torch.allclose(got, vltrain.load(oc, device="cpu").encode_texts(LONG), rtol=0, atol=OPEN_CLIP_TOL)
        readme = (oc / "README.md").read_text()
        assert f"cut at {max_len} tokens" in readme
        assert (f"context_length={max_len}" in readme) == (max_len < CONTEXT)

        plain = exported(run_dir, tmp_path / f"vl-{max_len}", "vltrain")
        assert AutoTokenizer.from_pretrained(str(plain / "tokenizer")).model_max_length == max_len
        assert f"truncated to {max_len} tokens" in (plain / "README.md").read_text()
        meta = json.loads((plain / "config.json").read_text())["preprocessing"]
        assert (meta["max_length"], meta["model_max_length"]) == (max_len, max_len)
    at_40, at_77 = (vltrain.load(tmp_path / f"hf-{n}", device="cpu").encode_texts(LONG[1:2]) for n in (40, CONTEXT))
    assert (at_40 - at_77).abs().max() > 1000 * ULPS  # the two exports do cut the 62-token caption differently
