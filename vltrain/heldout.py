"""The loop's periodic checks: TOnICS' curriculum refresh check (3.3) and the held-out evaluation (retrieval, and
zero-shot on eval.zeroshot_folder) that keeps best.pt."""

import json
import os

from vltrain.api import pixel_transform
from vltrain.resume import Run, RunState, save_checkpoint
from vltrain.distributed import broadcast
from vltrain.evaluate import drop_images, embed_split, heldout_r1, heldout_recall, val_triplet_sim
from vltrain.figures import plot_curriculum
from rich.console import Console

from vltrain.runlog import RunLog
from vltrain.zeroshot import read_templates, score_folder


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
    """Rank 0: held-out retrieval (triplets: the aligner's noun-image task) and eval.zeroshot_folder's zero-shot
    scores, logged; best.pt when eval.best_by's score improves.

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
    if cfg.eval.zeroshot_folder:  # the eval row holds both; a run without held-out split scores zero-shot alone
        result = {**(result or {}), **zeroshot_scores(run, state.step, device, report.console)}
    report.last_eval = result
    if result is None:
        return
    report.val(state.step, result)
    score = result.get(cfg.eval.best_by)  # None: no held-out split to score, and best.pt follows mean recall
    if score is not None and score > state.best:
        state.best = score
        save_checkpoint(run.best_path, run, state, every_rank=False)


def zeroshot_scores(run: Run, step: int, device, console: Console) -> dict:
    """Rank 0: eval.zeroshot_folder scored as `vltrain eval --zeroshot-folder` scores the checkpoint (the same
    function, transform, templates, batch size and loader workers): its metrics under zeroshot_* keys, printed."""
    cfg = run.cfg
    root = cfg.eval.zeroshot_folder
    workers = min(max(cfg.data.workers, 0), os.cpu_count() or 1)  # as `vltrain eval` reads the recorded value
    zs = score_folder(run.model, root, pixel_transform(run.model, cfg.data.image_size),
                      read_templates(cfg.eval.zeroshot_templates) if cfg.eval.zeroshot_templates else None,
                      cfg.data.max_len, cfg.batch_size, workers, device)
    skipped = f"; {zs['skipped']} undecodable image(s) left out" if zs["skipped"] else ""
    console.print(f"step {step} zero-shot on {zs['images']} images of {zs['classes']} classes ({root}): top-1 "
                  f"{zs['top1']:.1f}, top-5 {zs['top5']:.1f}, mean per class {zs['mean_per_class']:.1f} (chance "
                  f"{zs['chance']['top1']:.1f}){skipped}", highlight=False, markup=False)
    return {"zeroshot_top1": zs["top1"], "zeroshot_top5": zs["top5"], "zeroshot_mean_per_class": zs["mean_per_class"],
            "zeroshot_images": zs["images"], "zeroshot_classes": zs["classes"],
            "zeroshot_chance": zs["chance"]}
