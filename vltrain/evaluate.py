"""Retrieval R@K (ITC similarity, optional ITM re-rank of the top-k) and zero-shot classification metrics."""

from collections.abc import Callable

import torch

KS = (1, 5, 10)


def recall_at_k(sim: torch.Tensor, txt2img: torch.Tensor, ks=KS) -> dict[str, float]:
    """sim (N_img, N_txt), txt2img (N_txt,) image index of each text -> i2t / t2i R@K in % and their mean."""
    n_img, n_txt = sim.shape
    positive = torch.zeros(n_img, n_txt, dtype=torch.bool)
    positive[txt2img, torch.arange(n_txt)] = True
    out = {}
    # rank of the best positive per image (i2t) and of the image per text (t2i)
    order_i2t = sim.argsort(dim=1, descending=True)
    first_hit = positive.gather(1, order_i2t).float().argmax(dim=1)
    order_t2i = sim.t().argsort(dim=1, descending=True)
    rank_t2i = (order_t2i == txt2img[:, None]).float().argmax(dim=1)
    for k in ks:
        out[f"i2t_r{k}"] = round(100 * (first_hit < k).float().mean().item(), 2)
        out[f"t2i_r{k}"] = round(100 * (rank_t2i < k).float().mean().item(), 2)
    out["mean_recall"] = round(sum(out.values()) / len(out), 2)
    return out


def chance_recall(n_img: int, n_txt: int, ks=KS) -> dict[str, float]:
    """Expected R@K of a random ranking with one positive per query, for the table beside the results."""
    return {**{f"i2t_r{k}": round(100 * min(1.0, k / n_txt), 2) for k in ks},
            **{f"t2i_r{k}": round(100 * min(1.0, k / n_img), 2) for k in ks}}


def itm_rerank(sim: torch.Tensor, k: int, itm_score: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> tuple:
    """ALBEF's re-rank: for each query, its ITC top-k get score = ITM match logit + ITC similarity, others -100.

    itm_score(image_idx (M,), text_idx (M,)) -> (M,) match logits. Returns (sim_i2t, sim_t2i), both (N_img, N_txt).
    """
    k = min(k, sim.shape[1], sim.shape[0])
    i2t = torch.full_like(sim, -100.0)
    for i in range(sim.shape[0]):
        top_sim, top = sim[i].topk(min(k, sim.shape[1]))
        i2t[i, top] = itm_score(torch.full_like(top, i), top) + top_sim
    t2i = torch.full_like(sim, -100.0)
    for j in range(sim.shape[1]):
        top_sim, top = sim[:, j].topk(min(k, sim.shape[0]))
        t2i[top, j] = itm_score(top, torch.full_like(top, j)) + top_sim
    return i2t, t2i


def rerank_recall(sim_i2t: torch.Tensor, sim_t2i: torch.Tensor, txt2img: torch.Tensor, ks=KS) -> dict[str, float]:
    """R@K when the two directions are ranked by different score matrices (after itm_rerank)."""
    a, b = recall_at_k(sim_i2t, txt2img, ks), recall_at_k(sim_t2i, txt2img, ks)
    out = {**{k_: v for k_, v in a.items() if k_.startswith("i2t")}, **{k_: v for k_, v in b.items() if k_.startswith("t2i")}}
    out["mean_recall"] = round(sum(out.values()) / len(out), 2)
    return out


def zeroshot_accuracy(image_embeds: torch.Tensor, class_embeds: torch.Tensor, labels: torch.Tensor) -> dict[str, float]:
    """image_embeds (N, D), class_embeds (C, D), both L2-normalised; labels (N,) -> top-1 / top-5 accuracy in %."""
    logits = image_embeds @ class_embeds.t()
    top = logits.topk(min(5, class_embeds.shape[0]), dim=1).indices
    hit = top == labels[:, None]
    return {"top1": round(100 * hit[:, 0].float().mean().item(), 2),
            "top5": round(100 * hit.any(dim=1).float().mean().item(), 2)}
