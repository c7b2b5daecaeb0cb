"""The figures vltrain draws: the learning curve and TOnICS' curriculum (written during a run), and the Grad-CAM
maps and soft masks of `vltrain gradcam` (SoftMask++ 4.1). matplotlib is imported by each function, on first use."""

from pathlib import Path

import numpy as np
import torch

from vltrain.api import load, read_image
from vltrain.softmask import caption_gradcam, soft_mask


def plot_learning_curve(rows: list[dict], path: Path) -> None:
    """Held-out R@1 both ways (with chance), zero-shot top-1 when eval.zeroshot_folder is scored (with its chance),
    and the training loss against steps, from metrics.jsonl rows, as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    loss = [(r["step"], r["total"]) for r in rows if "total" in r]
    val = [(r["step"], r["val"]) for r in rows if "val" in r and "i2t_r1" in r["val"]]
    zs = [(r["step"], r["val"]) for r in rows if "val" in r and "zeroshot_top1" in r["val"]]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.8))
    if loss:
        ax1.plot(*zip(*loss), color="tab:gray", lw=1)
    ax1.set(xlabel="step", ylabel="training loss (total)", title="loss")
    titles = []
    if val:
        steps = [s for s, _ in val]
        for key, label, colour in (("i2t_r1", "image→text R@1", "tab:blue"), ("t2i_r1", "text→image R@1", "tab:orange")):
            ax2.plot(steps, [v[key] for _, v in val], marker="o", color=colour, label=label)
        chance = val[-1][1]["chance"]["i2t_r1"]
        ax2.axhline(chance, color="black", ls="--", lw=1, label=f"chance ({chance:.1f}%)")
        titles.append(f"held-out retrieval ({val[-1][1]['n_val']} pairs)")
    if zs:
        last = zs[-1][1]
        ax2.plot([s for s, _ in zs], [v["zeroshot_top1"] for _, v in zs], marker="s", color="tab:green",
                 label=f"zero-shot top-1 ({last['zeroshot_classes']} classes)")
        chance = last["zeroshot_chance"]["top1"]
        ax2.axhline(chance, color="tab:green", ls=":", lw=1, label=f"zero-shot chance ({chance:.1f}%)")
        titles.append(f"zero-shot ({last['zeroshot_images']} images)")
    if titles:
        ax2.legend(fontsize=8)
        ax2.set_title(", ".join(titles), **({"fontsize": 10} if len(titles) > 1 else {}))
    ax2.set(xlabel="step", ylabel="R@1 / top-1 (%)" if zs else "R@1 (%)", ylim=(0, None))
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def plot_curriculum(log: list[dict], names: list[str], path: Path, top: int = 8) -> None:
    """P(entity) and the `top` object nodes with the most final mass across steps, as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [0] + [r["step"] for r in log]  # the curriculum starts with P(entity) = 1
    probs = np.array([np.eye(len(names))[0]] + [r["probs"] for r in log])
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(steps, probs[:, 0], color="black", lw=2, marker=".", label="entity")
    for k in (np.argsort(-probs[-1, 1:])[:top] + 1):
        ax.plot(steps, probs[:, k], label=names[k])
    ax.set(xlabel="step", ylabel="P_S(node)", ylim=(0, 1.02), title="TOnICS curriculum")
    ax.legend(fontsize=7, loc="center right")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def caption_words(tokenizer, ids: torch.Tensor) -> list[str]:
    """The caption's whole words as its word pieces spell them ("snow", "##board", "##er" -> "snowboarder")."""
    words = []
    for p in tokenizer.convert_ids_to_tokens(ids[0].tolist()):
        if p in tokenizer.all_special_tokens:
            continue
        if p.startswith("##") and words:
            words[-1] += p[2:]
        else:
            words.append(p)
    return words


def _offsets(tokenizer, ids: torch.Tensor, caption: str | None) -> list[tuple[int, int]] | None:
    """Per position of ids (1, L), the (start, end) in `caption` of the text its token came from (a fast tokenizer's
    offsets, the caption encoded again as ids were); None when they cannot be had."""
    if caption is None or not getattr(tokenizer, "is_fast", False):
        return None
    enc = tokenizer(caption, truncation=True, max_length=ids.shape[1], return_offsets_mapping=True)
    if enc["input_ids"] != ids[0].tolist():
        return None
    return [tuple(o) for o in enc["offset_mapping"]]


def _same_words(tokenizer, a: str, b: str) -> bool:
    """Whether two spellings are the same words to the tokenizer (its normaliser: lowercase, accents), as text."""
    norm = getattr(getattr(tokenizer, "backend_tokenizer", None), "normalizer", None)

    def fold(text: str) -> str:
        return " ".join((norm.normalize_str(text) if norm is not None else text).casefold().split())

    return fold(a) == fold(b)


def word_positions(tokenizer, ids: torch.Tensor, words: list[str], caption: str | None = None) -> dict[str, int]:
    """Each requested word -> the position in ids (1, L) of the first of its word pieces, where all of them stand as
    one whole caption word (a contiguous span that no ## piece continues); ValueError for a word not in the caption.

    Token ids cannot tell apart the words the vocabulary lacks: each is [UNK]. A span holding [UNK] matches only where
    the caption's own text is the word (`caption`: the text ids were encoded from; without it, never)."""
    pieces = tokenizer.convert_ids_to_tokens(ids[0].tolist())
    if not caption_words(tokenizer, ids):
        raise ValueError("the caption is empty: give the words the image shows")
    unk = tokenizer.unk_token
    offsets = _offsets(tokenizer, ids, caption) if unk in pieces else None
    found = {}
    for word in words:
        spans = [t for t in (tokenizer.tokenize(word), tokenizer.tokenize(" " + word)) if t]
        hits = [i for want in spans for i in range(len(pieces) - len(want) + 1)
                if pieces[i:i + len(want)] == want and not "".join(pieces[i + len(want):][:1]).startswith("##")
                and (unk not in want or (offsets is not None and _same_words(
                    tokenizer, caption[offsets[i][0]:offsets[i + len(want) - 1][1]], word)))]
        if not hits:
            shown = " ".join(caption_words(tokenizer, ids))
            raise ValueError(f"word {word[:80]!r} is not in the caption's tokens ({shown[:200]}): give whole words of "
                             "it")
        found[word] = min(hits)
    return found


def gradcam_figure(checkpoint, image, caption: str, words: list[str] | None, out, device: str = "auto") -> dict:
    """`vltrain gradcam`: the image, then per word its Grad-CAM map and soft mask over the image; returns a summary."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt


    loaded = load(checkpoint, device)
    model = loaded.net
    tok = loaded.tokenizer
    if model.fusion is None:
        raise ValueError(f"{checkpoint} has no fusion encoder (fusion_layers=0): Grad-CAM reads its cross-attention")
    rgb = read_image(image)  # a missing file, a FIFO, a decompression bomb: one line
    dev = loaded.device
    pixels = loaded.pixels([rgb]).to(dev)
    enc = tok([caption], truncation=True, max_length=loaded.max_len, return_tensors="pt")
    ids = enc["input_ids"].to(dev)
    mask = enc["attention_mask"].to(dev)
    if not words:
        words = caption_words(tok, ids)[:3]
    pos = word_positions(tok, ids, words, caption)
    cam, p_match = caption_gradcam(model, pixels, ids, mask)
    n = cam.shape[1]
    side = int(round(n ** 0.5))
    if side * side != n:
        raise ValueError(f"the image side has {n} tokens, not a square grid: nothing to draw")
    shown = np.asarray(rgb.resize((pixels.shape[-1], pixels.shape[-2])))
    fig, axes = plt.subplots(2, len(words) + 1, figsize=(3 * (len(words) + 1), 6.2), squeeze=False)
    for row in range(2):
        axes[row, 0].imshow(shown)
        axes[row, 0].set_title("image" if row == 0 else f"p(match) {p_match:.2f}", fontsize=9)
    for j, word in enumerate(words, start=1):
        row_cam = cam[pos[word]]
        for r, (grid, title) in enumerate(((row_cam, f"Grad-CAM '{word}'"),
                                           (1 - soft_mask(row_cam[None])[0], f"masked weight 1-M '{word}'"))):
            ax = axes[r, j]
            ax.imshow(shown)
            ax.imshow(grid.reshape(side, side).cpu().numpy(), cmap="jet", alpha=0.5, interpolation="bilinear",
                      extent=(0, shown.shape[1], shown.shape[0], 0))
            ax.set_title(title, fontsize=9)
    for ax in axes.flat:
        ax.axis("off")
    fig.suptitle(caption, fontsize=10)
    fig.tight_layout()
    fig.savefig(out, dpi=80)
    plt.close(fig)
    return {"words": {w: pos[w] for w in words}, "p_match": p_match, "tokens": n, "out": str(out)}
