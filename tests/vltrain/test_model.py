"""vltrain.model: shapes, bidirectional fusion (no causal mask), init from the text layers, ties, EMA, queues."""

import copy
import pytest
import torch

from vltrain.config import ModelConfig
from vltrain.model import IMAGE_STATS, build_model, build_tokenizer

B, L, V = 3, 7, 30522


def tiny(**kw) -> ModelConfig:
    """A tiny random model config (2-layer 32-wide BERT, 4-token CNN)."""
    base = dict(text_model="tiny", image_model="tiny", embed_dim=16, fusion_layers=2)
    return ModelConfig(**{**base, **kw})


@pytest.fixture
def model():
    torch.manual_seed(0)
    return build_model(tiny()).eval()


def batch(seed: int = 0):
    """Images (B, 3, 32, 32), ids (B, L) starting with [CLS], mask (B, L) with padding in the last two rows."""
    g = torch.Generator().manual_seed(seed)
    images = torch.randn(B, 3, 32, 32, generator=g)
    ids = torch.randint(1000, 2000, (B, L), generator=g)
    ids[:, 0] = 101
    mask = torch.ones(B, L, dtype=torch.long)
    mask[1, 5:] = 0
    mask[2, 3:] = 0
    return images, ids, mask


def test_shapes(model):
    images, ids, mask = batch()
    tokens, img_emb = model.encode_image(images)
    hidden, txt_emb = model.encode_text(ids, mask)
    fused = model.fuse(hidden, mask, tokens)
    assert tokens.shape == (B, 4, 32) and img_emb.shape == (B, 16)
    assert hidden.shape == (B, L, 32) and txt_emb.shape == (B, 16)
    assert torch.allclose(img_emb.norm(dim=-1), torch.ones(B)) and torch.allclose(txt_emb.norm(dim=-1), torch.ones(B))
    assert fused.shape == (B, L, 32)
    assert model.itm_logits(fused).shape == (B, 2)
    assert model.mlm_logits(fused).shape == (B, L, V)
    assert model.temperature().shape == ()
    assert model.image_mean == IMAGE_STATS["tiny"]["mean"] and model.image_std == IMAGE_STATS["tiny"]["std"]


def test_features_input_and_dual_encoder():
    model = build_model(tiny(image_model="features", feature_dim=24, fusion_layers=0)).eval()
    tokens, emb = model.encode_image(torch.randn(B, 5, 24))
    assert tokens.shape == (B, 5, 24) and emb.shape == (B, 16)
    assert model.image_mean is None
    with pytest.raises(RuntimeError, match="fusion_layers=0"):
        model.fuse(torch.randn(B, L, 32), torch.ones(B, L), tokens)


def test_bad_config_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="image_model must be one of"):
        build_model(tiny(image_model="resnet9000"))
    with pytest.raises(ValueError, match="local Hugging Face model folder"):
        build_model(tiny(text_model=str(tmp_path / "missing")))
    with pytest.raises(ValueError, match="fusion_layers must be in 0..2"):
        build_model(tiny(fusion_layers=3))


def test_fusion_cls_sees_later_tokens_and_image_not_padding(model):
    """The trap: with a causal self-attention (BertLayer is_decoder=True) [CLS] would never see the caption."""
    images, ids, mask = batch()
    tokens, _ = model.encode_image(images)
    hidden, _ = model.encode_text(ids, mask)
    cls = model.fuse(hidden, mask, tokens)[:, 0]

    # Perturb only the fusion input at a later, unpadded position: the text encoder's own (bidirectional) [CLS]
    # is held fixed, so any change must come through the fusion self-attention.
    later = hidden.clone()
    later[0, 4] += 1.0
    assert not torch.allclose(model.fuse(later, mask, tokens)[0, 0], cls[0], atol=1e-5)

    # The same through the whole text path: a later caption token.
    ids2 = ids.clone()
    ids2[0, 6] = 1999 if ids[0, 6] != 1999 else 1998
    hidden2, _ = model.encode_text(ids2, mask)
    hidden2[:, 0] = hidden[:, 0]  # isolate the fusion again
    assert not torch.allclose(model.fuse(hidden2, mask, tokens)[0, 0], cls[0], atol=1e-5)

    # Another image changes [CLS] (cross-attention reaches it).
    other, _ = model.encode_image(torch.randn(B, 3, 32, 32))
    assert not torch.allclose(model.fuse(hidden, mask, other)[:, 0], cls, atol=1e-5)

    # Padding beyond the mask changes nothing, in the fusion alone and through the text encoder.
    padded = hidden.clone()
    padded[2, 3:] = torch.randn(L - 3, 32)
    torch.testing.assert_close(model.fuse(padded, mask, tokens)[:, 0], cls)
    ids3 = ids.clone()
    ids3[2, 3:] = 0
    hidden3, _ = model.encode_text(ids3, mask)
    torch.testing.assert_close(model.fuse(hidden3, mask, tokens)[:, 0], cls, atol=1e-5, rtol=1e-5)


def test_fusion_initialised_from_last_text_layers():
    torch.manual_seed(0)
    m = build_model(ModelConfig(text_model="tiny", image_model="tiny", embed_dim=16, fusion_layers=1))
    text_layers = m.text_encoder.encoder.layer
    f, t = m.fusion[0], text_layers[-1]
    att = t.attention
    for ours, theirs in [(f.self_attn.q, att.self.query), (f.self_attn.k, att.self.key),
                         (f.self_attn.v, att.self.value), (f.self_attn.o, att.output.dense),
                         (f.self_attn.ln, att.output.LayerNorm), (f.ffn_in, t.intermediate.dense),
                         (f.ffn_out, t.output.dense), (f.ffn_ln, t.output.LayerNorm)]:
        torch.testing.assert_close(ours.weight, theirs.weight, rtol=0, atol=0)
        torch.testing.assert_close(ours.bias, theirs.bias, rtol=0, atol=0)
        assert ours.weight.data_ptr() != theirs.weight.data_ptr()  # copies, not shared tensors
    # Not from the first layer, and cross-attention is fresh (BERT init: zero bias, weights unlike any text layer).
    assert not torch.equal(f.self_attn.q.weight, text_layers[0].attention.self.query.weight)
    for lin in (f.cross_attn.q, f.cross_attn.k, f.cross_attn.v, f.cross_attn.o):
        assert torch.count_nonzero(lin.bias) == 0
        assert all(not torch.equal(lin.weight, tl.attention.self.query.weight) for tl in text_layers)
        assert abs(lin.weight.std().item() - 0.02) < 0.01


def bert_layer_pairs(f, t):
    """(ours, theirs) module pairs a fusion layer takes from a HF BertLayer: self-attention and feed-forward."""
    att = t.attention
    return [(f.self_attn.q, att.self.query), (f.self_attn.k, att.self.key), (f.self_attn.v, att.self.value),
            (f.self_attn.o, att.output.dense), (f.self_attn.ln, att.output.LayerNorm), (f.ffn_in, t.intermediate.dense),
            (f.ffn_out, t.output.dense), (f.ffn_ln, t.output.LayerNorm)]


@pytest.mark.parametrize("fusion_from", ["copy", "split"])
def test_fusion_layout_copy_or_split_takes_the_right_layers(monkeypatch, fusion_from):
    """split (ALBEF): text = first L - N layers, fusion = last N with fresh cross-attention; copy keeps all L."""
    import copy

    import vltrain.model as model_mod

    torch.manual_seed(1)
    pretrained = model_mod._build_text_encoder("tiny")  # the "pretrained" BERT both layouts start from
    ref = {k: v.clone() for k, v in pretrained.state_dict().items()}
    monkeypatch.setattr(model_mod, "_build_text_encoder", lambda name: copy.deepcopy(pretrained))
    n_layers, n = 2, 1
    m = build_model(tiny(fusion_layers=n, fusion_from=fusion_from))
    keep = n_layers - n if fusion_from == "split" else n_layers
    text = m.text_encoder
    assert len(text.encoder.layer) == text.config.num_hidden_layers == keep
    # The text encoder holds exactly the pretrained embeddings and its first `keep` layers, unchanged.
    want = {k: v for k, v in ref.items() if not k.startswith("encoder.layer.") or int(k.split(".")[2]) < keep}
    got = text.state_dict()
    assert set(got) == set(want)
    for k, v in want.items():
        torch.testing.assert_close(got[k], v, rtol=0, atol=0)
    # Fusion layer k = pretrained layer L - N + k (self-attention + FFN), in both layouts.
    for k, f in enumerate(m.fusion):
        i = n_layers - n + k
        for ours, theirs in bert_layer_pairs(f, pretrained.encoder.layer[i]):
            torch.testing.assert_close(ours.weight, ref[_name(pretrained, theirs) + ".weight"], rtol=0, atol=0)
            torch.testing.assert_close(ours.bias, ref[_name(pretrained, theirs) + ".bias"], rtol=0, atol=0)
        for lin in (f.cross_attn.q, f.cross_attn.k, f.cross_attn.v, f.cross_attn.o):  # fresh: BERT init
            assert torch.count_nonzero(lin.bias) == 0 and abs(lin.weight.std().item() - 0.02) < 0.01
            assert all(not torch.equal(lin.weight, v) for v in ref.values() if v.shape == lin.weight.shape)
    # The split model's text path is the pretrained BERT's first L - N layers: same hidden states.
    _, ids, mask = batch()
    with torch.no_grad():
        full = pretrained.eval()(input_ids=ids, attention_mask=mask, output_hidden_states=True).hidden_states
        hidden, _ = m.eval().encode_text(ids, mask)
    torch.testing.assert_close(hidden, full[keep])


def _name(root, module) -> str:
    return next(name for name, mod in root.named_modules() if mod is module)


def test_split_needs_a_text_layer_left():
    with pytest.raises(ValueError, match=r"fusion_from=split needs fusion_layers in 1..1"):
        build_model(tiny(fusion_layers=2, fusion_from="split"))
    with pytest.raises(ValueError, match="fusion_from must be one of copy, split"):
        build_model(tiny(fusion_from="albef"))


def test_mean_pooling_is_the_masked_mean_of_the_token_states():
    torch.manual_seed(0)
    m = build_model(tiny(fusion_layers=0, pooling="mean")).eval()
    _, ids, mask = batch()
    hidden, emb = m.encode_text(ids, mask)
    for b in range(B):  # by hand: the attended tokens' states summed one by one, divided by their count
        n = int(mask[b].sum())
        mean = sum(hidden[b, t] for t in range(L) if mask[b, t]) / n
        proj = m.text_proj(mean)
        torch.testing.assert_close(emb[b], proj / proj.norm(), rtol=1e-5, atol=1e-6)
    # padding does not move it: the same caption padded further gives the same embedding
    ids2, mask2 = torch.cat([ids, torch.zeros(B, 3, dtype=ids.dtype)], 1), torch.cat([mask, torch.zeros(B, 3)], 1)
    torch.testing.assert_close(m.encode_text(ids2, mask2.long())[1], emb, rtol=1e-5, atol=1e-6)
    cls = build_model(tiny(fusion_layers=0)).eval()
    cls.load_state_dict(m.state_dict())
    hidden, emb = cls.encode_text(ids, mask)
    proj = cls.text_proj(hidden[:, 0])
    torch.testing.assert_close(emb, proj / proj.norm(dim=-1, keepdim=True))
    with pytest.raises(ValueError, match="pooling must be one of cls, mean"):
        build_model(tiny(pooling="max"))


def test_fixed_temperature_gets_no_gradient_and_keeps_its_checkpoint_name():
    torch.manual_seed(0)
    m = build_model(tiny(fusion_layers=0, temp=0.02, temp_learnable=False))
    assert not m.temp.requires_grad and float(m.temperature()) == pytest.approx(0.02)
    images, ids, mask = batch()
    (m.encode_image(images)[1] @ m.encode_text(ids, mask)[1].t() / m.temperature()).sum().backward()
    assert m.temp.grad is None and m.text_proj.weight.grad is not None
    assert "temp" in m.state_dict() and "temp" in dict(m.named_parameters())
    learn = build_model(tiny(fusion_layers=0))
    learn.load_state_dict(m.state_dict())  # same names: a fixed-tau checkpoint loads into either
    assert learn.temp.requires_grad


def test_mlm_decoder_tied_to_word_embeddings(model):
    emb = model.text_encoder.get_input_embeddings().weight
    assert model.mlm_decoder.weight is emb
    assert model.mlm_decoder.bias.shape == (V,)
    # Tying survives the momentum deepcopy inside the copy.
    m = build_model(tiny(momentum=True))
    assert m.momentum.mlm_decoder.weight is m.momentum.text_encoder.get_input_embeddings().weight
    assert m.momentum.mlm_decoder.weight is not m.mlm_decoder.weight


def test_temperature_clamped(model):
    assert model.temperature().item() == pytest.approx(0.07)
    with torch.no_grad():
        model.temp.fill_(1.0)
    assert model.temperature().item() == pytest.approx(0.5)
    assert model.temp.item() == pytest.approx(0.5)  # the parameter itself is pulled back, as ALBEF does
    with torch.no_grad():
        model.temp.fill_(1e-6)
    assert model.temperature().item() == pytest.approx(0.001)


def test_temperature_called_twice_in_one_graph_backprops(model):
    with torch.no_grad():
        model.temp.fill_(0.9)
    loss = 1 / model.temperature() + 1 / model.temperature()
    loss.backward()
    assert model.temp.grad is not None


def test_momentum_update_moves_by_one_minus_m():
    torch.manual_seed(0)
    m = build_model(tiny(momentum=True, momentum_m=0.9))
    online = {n: p for n, p in m.named_parameters() if not n.startswith("momentum.")}
    mom = dict(m.momentum.named_parameters())
    assert set(online) == set(mom)
    assert all(not p.requires_grad for p in m.momentum.parameters())
    assert all(torch.equal(online[n], mom[n]) for n in online)  # starts as an exact copy

    with torch.no_grad():
        for p in online.values():
            p.add_(torch.randn_like(p))
    before = {n: p.clone() for n, p in mom.items()}
    m.momentum_update()
    for n, p in online.items():
        torch.testing.assert_close(mom[n] - before[n], 0.1 * (p - before[n]), rtol=1e-4, atol=1e-6)
    # The momentum copy answers the same methods.
    images, ids, mask = batch()
    tokens, _ = m.momentum.encode_image(images)
    hidden, _ = m.momentum.encode_text(ids, mask)
    assert m.momentum.mlm_logits(m.momentum.fuse(hidden, mask, tokens)).shape == (B, L, V)


def test_queue_enqueue_with_wraparound():
    torch.manual_seed(0)
    m = build_model(tiny(queue_size=5))
    assert m.image_queue.shape == (16, 5) and m.text_queue.shape == (16, 5) and int(m.queue_ptr) == 0
    torch.testing.assert_close(m.image_queue.norm(dim=0), torch.ones(5))
    names = dict(m.named_buffers())
    assert {"image_queue", "text_queue", "queue_ptr"} <= set(names)  # so checkpoints hold them

    img1, txt1 = torch.randn(3, 16), torch.randn(3, 16)
    m.dequeue_and_enqueue(img1, txt1)
    torch.testing.assert_close(m.image_queue[:, :3], img1.T)
    torch.testing.assert_close(m.text_queue[:, :3], txt1.T)
    assert int(m.queue_ptr) == 3

    img2, txt2 = torch.randn(3, 16), torch.randn(3, 16)
    m.dequeue_and_enqueue(img2, txt2)  # columns 3, 4, then wraps to 0
    torch.testing.assert_close(m.image_queue[:, [3, 4, 0]], img2.T)
    torch.testing.assert_close(m.text_queue[:, [3, 4, 0]], txt2.T)
    torch.testing.assert_close(m.image_queue[:, 1:3], img1[1:].T)  # untouched
    assert int(m.queue_ptr) == 1

    big_img, big_txt = torch.randn(7, 16), torch.randn(7, 16)  # larger than the queue: the last Q rows win
    m.dequeue_and_enqueue(big_img, big_txt)
    torch.testing.assert_close(m.image_queue[:, [1, 2, 3, 4, 0]], big_img[-5:].T)
    assert int(m.queue_ptr) == 1


def test_frozen_image_encoder_gets_no_grad_and_stays_in_eval():
    m = build_model(tiny(freeze_image=True)).train()
    assert not m.image_encoder.training and m.text_encoder.training
    assert all(not p.requires_grad for p in m.image_encoder.parameters())
    images, ids, mask = batch()
    tokens, emb = m.encode_image(images)
    emb.sum().backward()
    assert m.image_proj.weight.grad is not None


def test_autocast_forward(model):
    images, ids, mask = batch()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        tokens, img_emb = model.encode_image(images)
        hidden, txt_emb = model.encode_text(ids, mask)
        logits = model.itm_logits(model.fuse(hidden, mask, tokens))
    assert logits.shape == (B, 2) and torch.isfinite(logits.float()).all()


def test_tokenizer_matches_tiny_vocab(model):
    tok = build_tokenizer(tiny())
    assert len(tok) == model.text_encoder.config.vocab_size == V


@pytest.mark.slow
def test_packaged_minilm_and_efficientnet_forward():
    torch.manual_seed(0)
    cfg = ModelConfig(momentum=True, queue_size=8)
    m = build_model(cfg).eval()
    tok = build_tokenizer(cfg)
    enc = tok(["a red bicycle leaning on a wall", "two dogs"], padding=True, truncation=True,
              max_length=32, return_tensors="pt")
    ids, mask = enc["input_ids"], enc["attention_mask"]
    n = ids.shape[1]
    with torch.no_grad():
        tokens, img_emb = m.encode_image(torch.randn(2, 3, 224, 224))
        hidden, txt_emb = m.encode_text(ids, mask)
        fused = m.fuse(hidden, mask, tokens)
        itm, mlm = m.itm_logits(fused), m.mlm_logits(fused)
    assert tokens.shape == (2, 49, 1280) and img_emb.shape == (2, 256)
    assert hidden.shape == (2, n, 384) and txt_emb.shape == (2, 256)
    assert fused.shape == (2, n, 384) and itm.shape == (2, 2) and mlm.shape == (2, n, V)
    assert m.image_mean == IMAGE_STATS["efficientnet-lite0"]["mean"] and m.image_size == 224
    # Fusion layer i starts from MiniLM layer 4 + i (the last two of six).
    layers = m.text_encoder.encoder.layer
    assert len(layers) == 6
    for f, t in zip(m.fusion, layers[4:]):
        assert torch.equal(f.self_attn.q.weight, t.attention.self.query.weight)
        assert torch.equal(f.ffn_out.weight, t.output.dense.weight)
    assert m.mlm_decoder.weight is m.text_encoder.get_input_embeddings().weight


def test_momentum_update_is_bit_identical_to_the_per_tensor_ema_and_follows_replaced_tensors():
    """The multi-tensor update against the plain loop it replaced, mom.mul_(m).add_(p, alpha=1 - m) per parameter
    and float buffer (integer counters copied), over three steps; then a parameter replaced by a new object (as a
    load by assignment does) is followed, not the stale one."""
    torch.manual_seed(0)
    m = build_model(tiny(momentum=True, momentum_m=0.9))
    ref = copy.deepcopy(m)
    for step in range(3):
        with torch.no_grad():
            for model in (m, ref):
                torch.manual_seed(step)
                for n, p in model.named_parameters():
                    if not n.startswith("momentum."):
                        p.add_(torch.randn_like(p))
                for n, b in model.named_buffers():
                    if not n.startswith("momentum.") and b.is_floating_point():
                        b.add_(1.0)
        m.momentum_update()
        with torch.no_grad():  # the former implementation, by name
            mom, mom_buf = dict(ref.momentum.named_parameters()), dict(ref.momentum.named_buffers())
            for n, p in ref.named_parameters():
                if not n.startswith("momentum."):
                    mom[n].mul_(0.9).add_(p, alpha=1 - 0.9)
            for n, b in ref.named_buffers():
                if n in mom_buf:
                    mom_buf[n].mul_(0.9).add_(b, alpha=1 - 0.9) if b.is_floating_point() else mom_buf[n].copy_(b)
        for (n, a), (_, b) in zip(m.momentum.state_dict().items(), ref.momentum.state_dict().items()):
            assert torch.equal(a, b), n
    m.text_proj.weight = torch.nn.Parameter(torch.ones_like(m.text_proj.weight))
    m.momentum_update()
    torch.testing.assert_close(m.momentum.text_proj.weight,
                               0.9 * ref.momentum.text_proj.weight + 0.1 * torch.ones_like(m.text_proj.weight))
