"""Pure loss and sampling functions for ITC (plain, distilled, focal, sigmoid, consistency), ITM, MLM and TOnICS."""

import math
from collections.abc import Iterable

import torch
import torch.nn.functional as F

# Conventions shared by the ITC family: logits are similarities already divided by the temperature, shape
# (B, B+Q) with the B in-batch candidates first and Q queue entries after them; row i's positive is column i.
# Half-precision inputs (autocast) are upcast before any softmax: exp/log in bf16 loses the small
# probabilities the contrastive losses live on. float64 stays float64 so the tests can gradcheck.


def upcast(x: torch.Tensor) -> torch.Tensor:
    """Upcast float16/bfloat16 to float32, keep float32/float64 (a float64 test stays float64): (...) -> (...)."""
    return x if x.dtype in (torch.float32, torch.float64) else x.float()


def _check_itc(logits: torch.Tensor) -> None:
    """Raise ValueError unless logits is (B, B+Q) with Q >= 0."""
    if logits.dim() != 2 or logits.shape[1] < logits.shape[0]:
        raise ValueError(f"expected ITC logits of shape (B, B+Q), got {tuple(logits.shape)}")


def _diag(x: torch.Tensor) -> torch.Tensor:
    """Entries (i, i) of a (B, C) tensor with C >= B: (B, C) -> (B,)."""
    idx = torch.arange(x.shape[0], device=x.device)
    return x[idx, idx]


def _soft_xent(logits: torch.Tensor, targets: torch.Tensor | None) -> torch.Tensor:
    """Row-mean of -sum(targets * log_softmax(logits)); None = one-hot on the diagonal: (B, C) -> ()."""
    _check_itc(logits)
    logp = upcast(logits).log_softmax(dim=-1)
    if targets is None:
        return -_diag(logp).mean()
    if targets.shape != logits.shape:
        raise ValueError(f"targets shape {tuple(targets.shape)} != logits shape {tuple(logits.shape)}")
    # Targets are constants in every method here (one-hot or momentum-model outputs).
    return -(targets.detach().to(logp.dtype) * logp).sum(dim=-1).mean()


def itc_logits(image_feat: torch.Tensor, text_feat: torch.Tensor, image_keys: torch.Tensor, text_keys: torch.Tensor,
               temp: torch.Tensor | float, image_queue: torch.Tensor | None = None,
               text_queue: torch.Tensor | None = None, detach_keys: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Queries against in-batch keys then queue columns, over temp: (B, E) x4, (E, Q) x2 -> (B, B+Q) x2."""
    if detach_keys:
        # GRIT-VLP's released code: sim_i2t = image_feat @ sg(text_feat).T, sim_t2i = text_feat @ sg(image_feat).T,
        # so each direction's gradient reaches its query side only.
        image_keys = image_keys.detach()
        text_keys = text_keys.detach()
    text_all = _with_queue(text_keys, text_queue)
    image_all = _with_queue(image_keys, image_queue)
    return image_feat @ text_all / temp, text_feat @ image_all / temp


def _with_queue(keys: torch.Tensor, queue: torch.Tensor | None) -> torch.Tensor:
    """In-batch keys (B, E) followed by queue columns (E, Q), which never carry gradient -> (E, B+Q)."""
    return keys.t() if queue is None else torch.cat([keys.t(), queue.clone().detach().to(keys.dtype)], dim=1)


def dedupe_targets(same: torch.Tensor, columns: int) -> torch.Tensor:
    """ITC targets with every in-batch duplicate as a positive, mass spread evenly: (B, G) bool -> (B, columns).

    G >= B is the number of in-batch keys (B, or every rank's B_global under torchrun, this rank's rows first),
    row i's own pair at column i."""
    b, g = same.shape
    if g < b or columns < g:
        raise ValueError(f"expected a (B, G) mask with G >= B and columns >= G, got {tuple(same.shape)} and {columns}")
    # The diagonal is always a positive, whatever the mask says; queue columns stay negatives (no caption known).
    pos = same.bool() | torch.eye(b, g, dtype=torch.bool, device=same.device)
    t = pos.float() / pos.sum(dim=1, keepdim=True)
    return F.pad(t, (0, columns - g))


def itc_loss(logits_i2t: torch.Tensor, logits_t2i: torch.Tensor,
             targets_i2t: torch.Tensor | None = None, targets_t2i: torch.Tensor | None = None) -> torch.Tensor:
    """ALBEF ITC: mean over both directions of the row-mean soft cross-entropy: (B, B+Q) x2 [+ targets] -> ()."""
    return (_soft_xent(logits_i2t, targets_i2t) + _soft_xent(logits_t2i, targets_t2i)) / 2


def sigmoid_itc_loss(logits: torch.Tensor, positives: torch.Tensor | None = None) -> torch.Tensor:
    """SigLIP's loss (Zhai et al. 2023, 3.1 and Algorithm 1): -(1/B) sum over all (i, j) of log sigmoid(z_ij l_ij),
    z = +1 for row i's positives (column i, and `positives`' True entries) and -1 elsewhere: (B, G) logits
    l = t x_i.y_j + b (G >= B in-batch columns, row i's pair at column i)[, (B, G) bool] -> ().

    The 1/B (rows, not pairs) is SigLIP's, as transformers' SiglipModel(return_loss=True) takes it. Under torchrun the
    rows are this rank's images and the columns every rank's texts: the ranks' mean is the loss of the global batch."""
    _check_itc(logits)
    b, g = logits.shape
    pos = torch.eye(b, g, dtype=torch.bool, device=logits.device)
    if positives is not None:
        pos = pos | positives.bool()
    x = upcast(logits)
    return -F.logsigmoid(torch.where(pos, x, -x)).sum() / b


@torch.no_grad()
def distill_targets(logits_m: torch.Tensor, alpha: float, hard: torch.Tensor | None = None) -> torch.Tensor:
    """ALBEF targets alpha*softmax(logits_m) + (1-alpha)*hard, hard = one-hot(i) by default: (B, B+Q) -> (B, B+Q)."""
    _check_itc(logits_m)
    p = upcast(logits_m.detach()).softmax(dim=-1)
    if hard is None:
        hard = torch.zeros_like(p)
        idx = torch.arange(p.shape[0], device=p.device)
        hard[idx, idx] = 1.0
    elif hard.shape != p.shape:
        raise ValueError(f"hard targets shape {tuple(hard.shape)} != logits shape {tuple(p.shape)}")
    return alpha * p + (1 - alpha) * hard.to(p.dtype)


def _focal_row_mean(logits: torch.Tensor, gamma: float) -> torch.Tensor:
    """Row-mean of -(1 - p_ii)^gamma * log p_ii: (B, B+Q) -> ()."""
    _check_itc(logits)
    logp_pos = _diag(upcast(logits).log_softmax(dim=-1))
    # The modulating factor keeps its gradient, as in the original focal loss (Lin et al.).
    return -((1 - logp_pos.exp()) ** gamma * logp_pos).mean()


def focal_itc_loss(logits_i2t: torch.Tensor, logits_t2i: torch.Tensor, gamma: float = 2.0) -> torch.Tensor:
    """SoftMask++ focal ITC, averaged over both directions; gamma=0 is plain one-hot ITC: (B, B+Q) x2 -> ()."""
    return (_focal_row_mean(logits_i2t, gamma) + _focal_row_mean(logits_t2i, gamma)) / 2


def itc_consistency_loss(logits_i2t: torch.Tensor, logits_t2i: torch.Tensor, in_batch: int | None = None
                         ) -> torch.Tensor:
    """GRIT eq. 6: mean_i 1/2[KL(sg(p_i2t[i]) || p_t2i[i]) + KL(sg(p_t2i[i]) || p_i2t[i])]: (B, B+Q) x2 -> ().

    in_batch: how many leading columns are in-batch keys (None = B; under DDP the global batch)."""
    # GRIT eq. 6 reads KL(p~v2t(V) || pt2v(T)) + KL(p~t2v(T) || pv2t(V)) with p~ = sg(p): the stop-gradient
    # side is the first KL argument (the target), so each direction is pulled towards the other one.
    # lambda_cons (0.2 in the paper) is applied by the caller. Only the in-batch B x B block is used:
    # p^{v2t}(V) and p^{t2v}(T) in GRIT eq. 1 are softmaxes over the N in-batch pairs, not over a queue.
    _check_itc(logits_i2t)
    _check_itc(logits_t2i)
    b = logits_i2t.shape[0] if in_batch is None else in_batch
    logp_i2t = upcast(logits_i2t[:, :b]).log_softmax(dim=-1)
    logp_t2i = upcast(logits_t2i[:, :b]).log_softmax(dim=-1)
    tgt_i2t = logp_i2t.detach()
    tgt_t2i = logp_t2i.detach()
    kl_i2t_to_t2i = (tgt_i2t.exp() * (tgt_i2t - logp_t2i)).sum(dim=-1)
    kl_t2i_to_i2t = (tgt_t2i.exp() * (tgt_t2i - logp_i2t)).sum(dim=-1)
    return ((kl_i2t_to_t2i + kl_t2i_to_i2t) / 2).mean()


@torch.no_grad()
def _hard_negative_weights_1(logits: torch.Tensor, exclude: torch.Tensor | None, width: int | None) -> torch.Tensor:
    """In-batch softmax, 0 on the diagonal and excluded pairs, uniform over allowed pairs for dead rows: -> (B, W)."""
    _check_itc(logits)
    b = logits.shape[0]
    width = b if width is None else width
    if not b <= width <= logits.shape[1]:
        raise ValueError(f"width {width} must lie between the batch {b} and the logits' {logits.shape[1]} columns")
    w = upcast(logits[:, :width].detach()).softmax(dim=-1)
    allowed = ~torch.eye(b, width, dtype=torch.bool, device=w.device)
    if exclude is not None:
        allowed &= ~exclude.bool()
    # Non-finite logits give NaN rows; treat them like underflowed rows rather than crash torch.multinomial.
    w = torch.where(allowed & torch.isfinite(w), w, torch.zeros_like(w))
    # A confident positive can underflow every negative to 0 in float32; sampling still needs a distribution.
    # A row with no allowed pair at all stays 0: it has no negative to give.
    dead = w.sum(dim=-1, keepdim=True) <= 0
    uniform = allowed.to(w.dtype) / allowed.sum(dim=-1, keepdim=True).clamp(min=1)
    return torch.where(dead, uniform, w)


def hard_negative_weights(logits_i2t: torch.Tensor, logits_t2i: torch.Tensor, exclude: torch.Tensor | None = None,
                          width: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """ALBEF ITM hard-negative weights (unnormalised, 0 on the diagonal and on `exclude` (B, W) pairs, no grad):
    (B, W+...) x2 -> (B, W) x2 over the first W = `width` columns (default B: the local batch; every rank's batch
    under torchrun with global negatives, this rank's rows first); a row whose every pair is excluded is all 0."""
    return (_hard_negative_weights_1(logits_i2t, exclude, width),
            _hard_negative_weights_1(logits_t2i, exclude, width))


@torch.no_grad()
def hardest_negatives(weights: torch.Tensor) -> torch.Tensor:
    """GRIT-VLP's top-1: per row the argmax over off-diagonal weights, ties to the lowest index: (B, W) -> (B,) long
    (W >= B columns, row i's positive at column i)."""
    b, width = _negative_weights_shape(weights)
    w = upcast(weights.detach()).nan_to_num(nan=-math.inf)
    diag = torch.eye(b, width, dtype=torch.bool, device=w.device)
    w = w.masked_fill(diag, -math.inf)
    # Explicit lowest-index tie-break rather than relying on argmax's (device-dependent in older torch) choice.
    # A row of -inf off the diagonal (all NaN) still gets the lowest off-diagonal index, never the diagonal.
    best = w.max(dim=1, keepdim=True).values
    cols = torch.arange(width, device=w.device).expand(b, width)
    hit = (w == best) & ~diag
    return torch.where(hit, cols, torch.full_like(cols, width)).min(dim=1).values


def _negative_weights_shape(weights: torch.Tensor) -> tuple[int, int]:
    if weights.dim() != 2 or weights.shape[1] < weights.shape[0]:
        raise ValueError(f"expected (B, W) weights with W >= B, got {tuple(weights.shape)}")
    if weights.shape[1] < 2:
        raise ValueError("hard negatives need a batch of at least 2 pairs")
    return weights.shape[0], weights.shape[1]


def _negative_weights(weights: torch.Tensor) -> torch.Tensor:
    """The weights the negatives are drawn by: upcast, the diagonal (each row's positive) zeroed, checked."""
    b, width = _negative_weights_shape(weights)
    # Re-mask so that weights from anywhere (not only hard_negative_weights) can never yield the positive.
    w = upcast(weights.detach()).masked_fill(torch.eye(b, width, dtype=torch.bool, device=weights.device), 0.0)
    # Checked on the device (a CPU raises at once, a GPU fails the step's kernels): an `if` on the check's value
    # would wait for the whole step on a GPU, every step
    ok = (w >= 0).all() & (w.sum(dim=-1) > 0).all()
    try:
        torch._assert_async(ok, "every row of weights needs a positive off-diagonal entry and no negative ones")
    except RuntimeError as e:
        raise ValueError(str(e)) from None
    return w


@torch.no_grad()
def sample_hard_negatives(weights: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """One index per row drawn in proportion to weights, never the diagonal: (B, W) -> (B,) long (W >= B columns,
    row i's positive at column i)."""
    return torch.multinomial(_negative_weights(weights), 1, generator=generator).squeeze(1)


@torch.no_grad()
def sample_hard_negatives_at(weights: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """One index per row drawn in proportion to weights by inverse transform sampling at the uniform u in [0, 1),
    never the diagonal: (B, W), (B,) -> (B,) long. Row i's draw is the first column whose running sum of weights
    exceeds u_i times the row's sum, so each column is drawn with probability weight / sum, as by
    `sample_hard_negatives`; a compiled step (train.compile=step) draws so, its uniforms drawn before the graph."""
    w = _negative_weights(weights)
    width = w.shape[1]
    cdf = w.cumsum(dim=-1)
    at = torch.searchsorted(cdf, (u.to(cdf.dtype) * cdf[:, -1]).unsqueeze(1), right=True).squeeze(1)
    # u * sum can round up to the sum itself (u = 1 - 2^-24 in float32), past every column: the row's last column of
    # positive weight is then the draw, as it is for the u just below
    cols = torch.arange(width, device=w.device)
    last = torch.where(w > 0, cols, torch.zeros_like(cols)).amax(dim=1)
    return torch.minimum(at, last)


def itm_loss(itm_logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Cross-entropy over B positives and 2B hard negatives (label 1 = match; -100: a row left out, as a row without
    a negative is): (3B, 2), (3B,) -> (), the mean over the rows not left out."""
    return F.cross_entropy(upcast(itm_logits), labels)


def softmask_itm_loss(masked_itm_logits: torch.Tensor) -> torch.Tensor:
    """SoftMask++ eq. 12: positive pairs with soft-masked image tokens are still matches: (B, 2) -> () CE, label 1."""
    labels = torch.ones(masked_itm_logits.shape[0], dtype=torch.long, device=masked_itm_logits.device)
    return F.cross_entropy(upcast(masked_itm_logits), labels)


def mlm_mask(input_ids: torch.Tensor, prob: float, special_ids: Iterable[int], mask_id: int, vocab_size: int,
             generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """BERT masking (select w.p. prob; 80% [MASK], 10% random, 10% kept), labels -100 elsewhere: (B, L) -> (B, L) x2."""
    if not 0.0 <= prob <= 1.0:
        raise ValueError(f"mask probability must be in [0, 1], got {prob}")
    dev = input_ids.device
    # one comparison per special id: a tensor of the ids would be a copy from the host, which on a GPU waits for the
    # device's queue (a sync per step)
    special = torch.zeros_like(input_ids, dtype=torch.bool)
    for i in sorted(set(special_ids)):
        special |= input_ids == i
    selected = (torch.rand(input_ids.shape, generator=generator, device=dev) < prob) & ~special
    labels = torch.where(selected, input_ids, torch.full_like(input_ids, -100))
    # One uniform draw splits the selected positions 80/10/10.
    u = torch.rand(input_ids.shape, generator=generator, device=dev)
    # As in BERT, the random replacement is drawn from the whole vocabulary.
    random_ids = torch.randint(vocab_size, input_ids.shape, generator=generator, device=dev, dtype=input_ids.dtype)
    masked = torch.where(selected & (u < 0.8), torch.full_like(input_ids, mask_id), input_ids)
    masked = torch.where(selected & (u >= 0.8) & (u < 0.9), random_ids, masked)
    return masked, labels


MLM_TAIL = 1e-9  # mlm_cap: the chance per step that more positions are masked than the cap holds


def mlm_cap(n: int, prob: float, tail: float = MLM_TAIL) -> int:
    """How many masked positions the vocabulary head scores: a bound on the count of `mlm_mask`'s selections among
    n maskable tokens that is exceeded with probability below `tail`, capped at n; a host int (no device read).

    The count is Binomial(m, p), m <= n (each non-special token selected independently; a larger m only makes larger
    counts likelier), p = prob + 2^-24: float32's torch.rand takes values on a grid of step 2^-24 or finer, so
    P(u < prob) is prob rounded up to it. Bernstein's inequality for a sum of independent terms X_i - p <= 1 of
    total variance s^2 = n p (1 - p): P(X >= n p + t) <= exp(-t^2 / (2 (s^2 + t / 3))). Setting the right side to
    tail, with l = ln(1 / tail), gives t = l / 3 + sqrt(l^2 / 9 + 2 l s^2); a count above floor(n p + t) is at
    least n p + t. At tail 1e-9 (l = 20.7) that is n p + 6.4 s + 6.9 for large s: the Gaussian 6 s plus room for
    the binomial's longer right tail at small n p, where a 6 s bound would be exceeded far more often."""
    p = min(1.0, prob + 2.0 ** -24)
    l = math.log(1 / tail)
    t = l / 3 + math.sqrt(l * l / 9 + 2 * l * n * p * (1 - p))
    return min(n, math.floor(n * p + t))


def mlm_rows(labels: torch.Tensor, cap: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The first `cap` masked positions (labels != -100) in row order, at a size fixed without reading the device:
    (B, L) labels -> flat position indices (cap,), their labels (cap,) with -100 on the fill rows past the masked
    count (index 0: a real row, so finite), and how many masked positions were left out past the cap (0-d)."""
    flat = labels.reshape(-1)
    picked = flat != -100
    # nonzero_static: a fixed-size nonzero (a boolean index's nonzero must read its count back to size the output)
    at = torch.nonzero_static(picked, size=cap, fill_value=-1).squeeze(1)
    fill = at < 0
    at = at.clamp(min=0)
    kept = torch.where(fill, torch.full_like(at, -100), flat[at])
    return at, kept, picked.sum() - (~fill).sum()


def mlm_loss(logits: torch.Tensor, labels: torch.Tensor, soft_targets: torch.Tensor | None = None,
             alpha: float = 0.0) -> torch.Tensor:
    """(1-alpha)*CE + alpha*soft CE vs momentum probs at masked positions: (B, L, V), (B, L)[, (B, L, V)] -> ();
    also (N, V), (N,)[, (N, V)] for logits already taken at the masked positions (what train_step passes)."""
    # (alpha may be a 0-d tensor, a compiled step's: tested only where it cannot be one, so that nothing is read)
    if soft_targets is None and alpha > 0:
        raise ValueError("mlm_loss with alpha > 0 needs soft_targets")
    # Fixed-size ops over every position given, the unmasked ones zeroed out of the sums: no read of how many were
    # masked (a sync per step on a GPU). train_step passes the masked positions only (all picked), where the sums
    # and the count are the mean's own, bit for bit. Nothing masked gives 0 with the graph still connected.
    picked = labels != -100
    n = picked.sum().clamp(min=1)
    logp = upcast(logits).log_softmax(dim=-1)
    nll = -logp.gather(-1, labels.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    ce = torch.where(picked, nll, torch.zeros_like(nll)).sum() / n
    if soft_targets is None or (not torch.is_tensor(alpha) and alpha == 0):
        return ce
    soft = -(soft_targets.detach().to(logp.dtype) * logp).sum(dim=-1)
    soft = torch.where(picked, soft, torch.zeros_like(soft)).sum() / n
    return (1 - alpha) * ce + alpha * soft


def tonics_ir_loss(scores: torch.Tensor) -> torch.Tensor:
    """TOnICS L_IR: mean_i -log softmax_j s(i, j) at j = i (caption i retrieves image i): (B, B) -> ()."""
    return -_diag(upcast(scores).log_softmax(dim=1)).mean()


def tonics_tr_loss(scores: torch.Tensor) -> torch.Tensor:
    """TOnICS L_TR: mean_i -log softmax_j s(j, i) at j = i (image i retrieves caption i): (B, B) -> ()."""
    return -_diag(upcast(scores).log_softmax(dim=0)).mean()
