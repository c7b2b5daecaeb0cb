"""Transformer blocks for the fusion encoder and the TOnICS aligner, and the noun pooling the aligner reads."""

import torch
import torch.nn.functional as F
from torch import nn


def bert_init(module: nn.Module, std: float = 0.02) -> None:
    """BERT's initialisation (normal(0, std) weights, zero bias, unit LayerNorm) for fresh layers."""
    for m in module.modules():
        if isinstance(m, nn.Linear):
            nn.init.normal_(m.weight, std=std)
            nn.init.zeros_(m.bias)
        elif isinstance(m, nn.LayerNorm):
            nn.init.ones_(m.weight)
            nn.init.zeros_(m.bias)


class Attention(nn.Module):
    """Multi-head attention with BERT's post-LN residual: LN(x + drop(o(attn(q(x), k(c), v(c)))))."""

    def __init__(self, dim: int, heads: int, eps: float, attn_drop: float, drop: float):
        super().__init__()
        self.heads, self.attn_drop = heads, attn_drop
        self.q, self.k, self.v, self.o = (nn.Linear(dim, dim) for _ in range(4))
        self.ln, self.drop = nn.LayerNorm(dim, eps=eps), nn.Dropout(drop)

    def keys_values(self, ctx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """ctx (M, S, D) -> its keys and values, (M, S, D) each: projected once per distinct context when several
        query rows read the same one (`forward`'s kv and rows; VLModel.fuse's image_rows)."""
        return self.k(ctx), self.v(ctx)

    def forward(self, x: torch.Tensor, ctx: torch.Tensor | None, key_mask: torch.Tensor | None = None,
                return_attn: bool = False, kv: tuple[torch.Tensor, torch.Tensor] | None = None,
                rows: torch.Tensor | None = None):
        """x (B, L, D) attends to ctx (B, S, D); key_mask (B, S) bool, True = attend -> (B, L, D).

        return_attn: also the attention probabilities (B, H, L, S) before dropout, for Grad-CAM (SoftMask++).
        kv: `keys_values` already computed (ctx is then not read); rows (B,) long: each query row's context among
        M distinct ones (ctx or kv holding M rows), so that keys and values are projected per context, not per row:
        the same numbers as projecting the indexed contexts, up to the matmul's rounding on another row count.
        """
        b, l, d = x.shape

        def split(t: torch.Tensor) -> torch.Tensor:
            return t.view(b, -1, self.heads, d // self.heads).transpose(1, 2)

        # No causal mask anywhere: every caption token, [CLS] included, sees the whole caption. (transformers'
        # BertLayer takes cross-attention only as a decoder, whose self-attention is causal: a fusion [CLS] built
        # that way never sees the caption, and ITM learns nothing from the text.)
        mask = None if key_mask is None else key_mask[:, None, None, :]
        q = split(self.q(x))
        k, v = self.keys_values(ctx) if kv is None else kv
        if rows is not None:  # each row's context's keys and values, as an embedding lookup: forward and backward
            # (a sum per context of its rows' gradients) took 0.40 ms against index_select's 1.06 on CPU for 24 rows
            # of 32 contexts' 49 x 384
            k, v = (F.embedding(rows, t.reshape(t.shape[0], -1)).view(len(rows), *t.shape[1:]) for t in (k, v))
        k, v = split(k), split(v)
        probs = None
        if return_attn:
            # The explicit softmax(QK^T / sqrt(d)) V: the fused kernel never materialises the probabilities, and
            # Grad-CAM needs them as a tensor in the graph. Only the steps that ask for maps pay for it.
            scores = q @ k.transpose(-2, -1) / (d // self.heads) ** 0.5
            if mask is not None:
                scores = scores.masked_fill(~mask, float("-inf"))
            probs = scores.softmax(dim=-1)
            a = F.dropout(probs, self.attn_drop, self.training) @ v
        else:
            a = F.scaled_dot_product_attention(q, k, v, attn_mask=mask,
                                               dropout_p=self.attn_drop if self.training else 0.0)
        out = self.ln(x + self.drop(self.o(a.transpose(1, 2).reshape(b, l, d))))
        return (out, probs) if return_attn else out


class FusionLayer(nn.Module):
    """ALBEF fusion layer: bidirectional self-attention, cross-attention to image tokens, feed-forward; post-LN."""

    def __init__(self, dim: int, heads: int, ffn_dim: int, eps: float, attn_drop: float, drop: float):
        super().__init__()
        self.self_attn = Attention(dim, heads, eps, attn_drop, drop)
        self.cross_attn = Attention(dim, heads, eps, attn_drop, drop)
        self.ffn_in, self.ffn_out = nn.Linear(dim, ffn_dim), nn.Linear(ffn_dim, dim)
        self.ffn_ln, self.drop = nn.LayerNorm(dim, eps=eps), nn.Dropout(drop)

    def forward(self, x: torch.Tensor, text_mask: torch.Tensor, image: torch.Tensor | None, return_attn: bool = False,
                kv: tuple[torch.Tensor, torch.Tensor] | None = None, rows: torch.Tensor | None = None):
        """x (B, L, D), text_mask (B, L) bool, image (B, N, D) -> (B, L, D) [, cross-attention probs (B, H, L, N)].

        kv, rows: the cross-attention's keys and values of M distinct images (`cross_attn.keys_values`, image then
        unused) and each row's image among them (`Attention.forward`)."""
        x = self.self_attn(x, x, text_mask)
        if return_attn:
            x, probs = self.cross_attn(x, image, return_attn=True, kv=kv, rows=rows)
        else:
            x, probs = self.cross_attn(x, image, kv=kv, rows=rows), None
        x = self.ffn_ln(x + self.drop(self.ffn_out(F.gelu(self.ffn_in(x)))))
        return (x, probs) if return_attn else x

    @torch.no_grad()
    def load_bert_layer(self, layer: nn.Module) -> None:
        """Copy self-attention and feed-forward weights from a HF BertLayer (RobertaLayer: the same modules) or a
        DistilBERT TransformerBlock (the same post-LN layout under other names); cross-attention stays fresh."""
        att = layer.attention
        if hasattr(layer, "sa_layer_norm"):  # DistilBERT
            pairs = [(self.self_attn.q, att.q_lin), (self.self_attn.k, att.k_lin), (self.self_attn.v, att.v_lin),
                     (self.self_attn.o, att.out_lin), (self.self_attn.ln, layer.sa_layer_norm),
                     (self.ffn_in, layer.ffn.lin1), (self.ffn_out, layer.ffn.lin2),
                     (self.ffn_ln, layer.output_layer_norm)]
        else:
            pairs = [(self.self_attn.q, att.self.query), (self.self_attn.k, att.self.key),
                     (self.self_attn.v, att.self.value), (self.self_attn.o, att.output.dense),
                     (self.self_attn.ln, att.output.LayerNorm), (self.ffn_in, layer.intermediate.dense),
                     (self.ffn_out, layer.output.dense), (self.ffn_ln, layer.output.LayerNorm)]
        for ours, theirs in pairs:
            ours.load_state_dict(theirs.state_dict())


class NounAligner(nn.Module):
    """TOnICS aligner head: s(i, j) = h_i . v_att(i, j) for every noun i and image j of a batch.

    v_att(i, j) is one transformer cross-attention layer (BERT's post-LN layout: attention with a residual on the
    query, then a feed-forward block) whose only query is the noun representation h_i and whose keys and values
    are the tokens of image j after a learnable linear projection. Keys and values are projected once per image
    and the B x B pairs are formed inside the attention einsums, so no (B*B, N, D) copy is ever built.
    """

    def __init__(self, dim: int, image_dim: int, heads: int, ffn_dim: int, eps: float, attn_drop: float,
                 drop: float):
        super().__init__()
        self.heads = heads
        self.image_proj = nn.Linear(image_dim, dim)
        self.q, self.k, self.v, self.o = (nn.Linear(dim, dim) for _ in range(4))
        self.ln, self.attn_drop, self.drop = nn.LayerNorm(dim, eps=eps), nn.Dropout(attn_drop), nn.Dropout(drop)
        self.ffn_in, self.ffn_out = nn.Linear(dim, ffn_dim), nn.Linear(ffn_dim, dim)
        self.ffn_ln = nn.LayerNorm(dim, eps=eps)

    def attend(self, nouns: torch.Tensor, image_tokens: torch.Tensor) -> torch.Tensor:
        """nouns (Bt, D), image tokens (Bi, N, D_img) -> v_att (Bt, Bi, D)."""
        bt, d = nouns.shape
        bi, n, _ = image_tokens.shape
        hd = d // self.heads
        img = self.image_proj(image_tokens)
        q = self.q(nouns).view(bt, self.heads, hd)
        k = self.k(img).view(bi, n, self.heads, hd)
        v = self.v(img).view(bi, n, self.heads, hd)
        att = self.attn_drop((torch.einsum("ahd,bnhd->abhn", q, k) / hd ** 0.5).softmax(dim=-1))
        a = torch.einsum("abhn,bnhd->abhd", att, v).reshape(bt, bi, d)
        x = self.ln(nouns[:, None, :] + self.drop(self.o(a)))
        return self.ffn_ln(x + self.drop(self.ffn_out(F.gelu(self.ffn_in(x)))))

    def forward(self, nouns: torch.Tensor, image_tokens: torch.Tensor) -> torch.Tensor:
        """nouns (Bt, D), image tokens (Bi, N, D_img) -> scores s (Bt, Bi), s[i, j] = nouns[i] . v_att(i, j)."""
        return torch.einsum("ad,abd->ab", nouns, self.attend(nouns, image_tokens))


def noun_states(hidden: torch.Tensor, noun_mask: torch.Tensor) -> torch.Tensor:
    """Mean of the word-piece states of each noun: hidden (B, L, D), noun_mask (B, L) bool -> (B, D).

    A noun cut off by truncation (an empty mask) gives a zero vector rather than NaN.
    """
    m = noun_mask.to(hidden.dtype).unsqueeze(-1)
    return (hidden * m).sum(dim=1) / m.sum(dim=1).clamp(min=1)


