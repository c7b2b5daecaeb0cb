"""The loop's periodic checks: TOnICS' curriculum refresh check (3.3) and the held-out evaluation that keeps best.pt."""

import json

from vltrain.resume import Run, RunState, save_checkpoint
from vltrain.distributed import broadcast
from vltrain.evaluate import drop_images, embed_split, heldout_r1, heldout_recall, val_triplet_sim
from vltrain.figures import plot_curriculum
from rich.console import Console

from vltrain.runlog import RunLog


def curriculum_check(run: Run, state: RunState, data, rank: int, device, console: Console) -> dict:
    """TOnICS: held-out image retrieval R@1, and a curriculum refresh when it reaches the threshold.

    Rank 0 checks and decides; the others follow its decision, so every rank's curriculum stays the same."""
    cfg = run.cfg
    sampler = run.sampler
    row = None
    if rank == 0:
        acc = heldout_r1(run.model, data.val, data.heldout, data.collate, cfg.batch_size, cfg.data.triplets, device)
        refreshed = acc >= cfg.sampler.threshold
        if refreshed:
            sampler.curriculum.refresh()
        row = {"step": state.step, "heldout_r1": round(acc, 4), "refreshed": refreshed,
               "probs": [round(float(p), 6) for p in sampler.curriculum.probs]}
        state.curriculum_log.append(row)
        (run.out / "curriculum.json").write_text(json.dumps({"nodes": data.names, "log": state.curriculum_log}))
        plot_curriculum(state.curriculum_log, data.names, run.out / "curriculum.png")
        console.print(f"step {state.step} tonics check: held-out R@1 {acc:.2f} on {len(data.heldout)} "
                      f"{'refresh' if refreshed else 'no refresh'} (threshold {cfg.sampler.threshold}), "
                      f"P(entity) {sampler.curriculum.probs[0]:.3f}", highlight=False)
    row = broadcast(row)
    if rank > 0:
        state.curriculum_log.append(row)
        if row["refreshed"]:
            sampler.curriculum.refresh()
    return row


def evaluate_heldout(run: Run, state: RunState, data, report: RunLog, device) -> None:
    """Rank 0: held-out retrieval (triplets: the aligner's noun-image task), logged; best.pt when it improves.

    Bad held-out samples (LoadCounts' reasons) are left out of both sides, and the result says how many."""
    cfg = run.cfg
    model = run.model
    txt2img = None
    if cfg.data.triplets:
        counts = data.val.shards.counts  # shared with the training view: this evaluation's share is the difference
        before = counts.skipped()
        sim = (val_triplet_sim(model, data.val, data.val_triplets, data.collate, cfg.batch_size, device)
               if len(data.val_triplets) >= 2 else None)
        after = counts.skipped()
        skipped = {"count": after["count"] - before["count"],
                   "reasons": {r: n - before["reasons"].get(r, 0) for r, n in after["reasons"].items()
                               if n > before["reasons"].get(r, 0)}}
    else:  # every caption of a multi-caption image is scored (the protocol of `vltrain eval`)
        # at most data.val_max held-out samples, the first in shard order: the cost of an evaluation stays flat in N
        emb = embed_split(model, cfg.shards, "val", cfg.data, cfg.batch_size, device, data.use_features,
                          limit=cfg.data.val_max)
        skipped = emb["skipped"]
        if data.heldout_keys and emb["n"]:  # the TOnICS refresh check's images are not scored
            emb = drop_images(emb, data.heldout_keys)
        # the embeddings, scored in bounded tiles (blocked_recall), not their (N, N) product
        sim, txt2img = ((emb["img"], emb["txt"]), emb["txt2img"]) if emb["n"] >= 2 else (None, None)
    # the held-out split's size, said only when data.val_max left some of it out (the metrics' rows stay as they were)
    capped = data.n_val if not cfg.data.triplets and 0 < cfg.data.val_max < data.n_val else None
    result = (heldout_recall(sim, "val triplets" if cfg.data.triplets else "val samples", state.step, txt2img,
                             skipped if skipped["count"] else None, capped)
              if sim is not None else None)
    report.last_eval = result
    if result is None:
        return
    report.val(state.step, result)
    if result["mean_recall"] > state.best:
        state.best = result["mean_recall"]
        save_checkpoint(run.best_path, run, state, every_rank=False)
