"""A run's training batches (`Feed`): the loader, epoch turnover, bad-sample stop, loader errors."""

import signal

import torch
from torch.utils.data import DataLoader

from vltrain.errors import TrainError
from vltrain.data.samples import loader_error
from vltrain.distributed import world

# Undecodable samples are skipped and counted; past this share of the samples read the data is called broken.
MAX_BAD_FRACTION = 0.01
MIN_READ_FOR_BAD_CHECK = 200  # before that, one bad sample among the first few is not yet a 1% problem


def check_bad_samples(counts, final: bool = False, features: bool = False) -> int:
    """The bad samples so far; a TrainError once they are more than 1% of those read (checked after 200 reads, or at
    an epoch's end). `features`: the data is `vlprep features` tokens, whose remedy is to make them again."""
    read, bad = counts.totals()
    if bad > MAX_BAD_FRACTION * read and (final or read >= MIN_READ_FOR_BAD_CHECK):
        share = f"({100 * bad / read:.1f}%, more than {100 * MAX_BAD_FRACTION:g}%"
        if features:  # the npy members disagree with meta.json's features record, or do not load
            why = ", ".join(f"{r} {n}" for r, n in sorted(counts.reasons().items()))
            raise TrainError(f"{bad} of {read} samples read had unusable npy features {share}: {why}): the cached "
                             "tokens are damaged; make them again with `vlprep features` (docs/FEATURES.md)")
        raise TrainError(f"{bad} of {read} samples read could not be decoded {share}): the data is damaged; "
                         "re-create it with `vlprep shards --decode-check`, which leaves such images out")
    return bad


class StopFetch(BaseException):
    """Raised by the run's signal handler while `Feed.next` waits for data (a hung mount, a FIFO as a shard): the
    read is given up, so the first Ctrl-C / SIGTERM stops the run at once. A BaseException, like KeyboardInterrupt,
    so that no `except Exception` on the way (a reader's skip-and-go-on handler) can swallow it."""


def _ignore_sigint(worker_id: int) -> None:
    """Loader workers leave Ctrl-C to the main process, which finishes its step and saves before stopping."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def make_loader(seed: int, dataset, sampler, collate, batch_size: int, workers: int,
                device: torch.device, prefetch: int = -1) -> DataLoader:
    """The run's one DataLoader, its workers forked once and kept across epochs (persistent_workers), each preparing
    `prefetch` batches ahead (-1: torch's default; no workers: none, as torch allows no prefetch_factor then)."""
    # A fork per epoch made every epoch's first step pay copy-on-write faults on the weights and AdamW
    # state. The workers learn the epoch through shared memory and reseed at its start
    # (samples.reseed_worker), so an epoch's samples and augmentations are a function of (seed, epoch)
    # only, as with workers started afresh.
    common = dict(collate_fn=collate, num_workers=workers, pin_memory=device.type == "cuda",
                  generator=torch.Generator().manual_seed(seed * 100_003), worker_init_fn=_ignore_sigint,
                  persistent_workers=workers > 0)
    if workers > 0 and prefetch > 0:
        common["prefetch_factor"] = prefetch
    if sampler is not None:  # index samplers: an epoch is a GRIT pass over the data or a TOnICS curriculum period
        return DataLoader(dataset, batch_sampler=sampler, **common)
    return DataLoader(dataset, batch_size=batch_size, drop_last=True, **common)


def epoch_batches(loader: DataLoader, epoch: int, seed: int, dataset, sampler) -> tuple:
    """(batch iterator, data RNG state) at the start of an epoch; both depend only on (seed, epoch)."""
    dataset.set_epoch(epoch)  # which caption of a multi-caption sample this epoch trains on; workers reseed for it
    if sampler is not None:
        sampler.set_epoch(epoch)
    return iter(loader), torch.Generator().manual_seed(seed * 100_003 + epoch + 1).get_state()


def next_batch(batches, rng_state: torch.Tensor) -> tuple[dict, torch.Tensor]:
    """next(batches) drawing augmentations from the data's own torch RNG state; returns (batch, new state)."""
    # With workers=0 the transforms run here and would share the global RNG with dropout, so a resumed run
    # replaying its epoch's first batches would crop differently. Workers have their own RNG already.
    with torch.random.fork_rng(devices=[]):
        torch.set_rng_state(rng_state)
        batch = next(batches)
        return batch, torch.get_rng_state()


class Feed:
    """A run's batches: `start(state)` opens the state's epoch and replays the batches it already consumed,
    `next(state)` returns (batch, None) or (None, the fault), advancing state.epoch / state.consumed."""

    def __init__(self, data, batch_sampler, seed: int, batch_size: int, workers: int, device: torch.device,
                 preloaded=None, prefetch: int = -1):
        self.data, self.batch_sampler, self.seed, self.prefetch = data, batch_sampler, seed, prefetch
        self.preloaded = preloaded  # an iterable of collated batches standing in for the loader, one pass an epoch
        self.batch_size, self.workers, self.device = batch_size, workers, device
        self.bad = 0  # bad (skipped) samples so far
        self.reading = False  # inside `next`: a signal handler may raise StopFetch to give up the read
        self.loader = None  # made on the first epoch, kept for the run

    def _open(self, epoch: int) -> None:
        if self.loader is None and self.preloaded is not None:
            self.loader = self.preloaded
        elif self.loader is None:
            self.loader = make_loader(self.seed, self.data.train, self.batch_sampler, self.data.collate,
                                      self.batch_size, self.workers, self.device, self.prefetch)
        self.batches, self.rng = epoch_batches(self.loader, epoch, self.seed, self.data.train, self.batch_sampler)

    def close(self) -> None:
        """Stop the loader's workers now, rather than when the last reference to the feed goes."""
        batches, self.batches, self.loader = getattr(self, "batches", None), None, None
        # torch's multi-worker iterator stops its workers in _shutdown_workers, which is also what its __del__ calls
        shutdown = getattr(batches, "_shutdown_workers", None)
        if shutdown is not None:
            shutdown()

    def io(self) -> dict | None:
        """Remote reads retried and shards left out (LoadCounts.io_totals), when there were any; else None."""
        totals = self.data.counts.io_totals() if hasattr(self.data.counts, "io_totals") else {}
        return totals if any(totals.values()) else None

    def start(self, state) -> None:
        self._open(state.epoch)
        for _ in range(state.consumed):  # the data position is replayed: this epoch's trained batches are redrawn
            _, self.rng = next_batch(self.batches, self.rng)

    def next(self, state) -> tuple[dict | None, Exception | None]:
        # A fault (a damaged shard, an empty epoch, too many undecodable samples) is returned, not raised, so that
        # under torchrun every rank learns of it at once instead of waiting in the next collective.
        # (None, None): a signal gave up the read (StopFetch); the caller stops, with nothing of this batch counted.
        try:
            self.reading = True
            try:
                return self._next(state)
            finally:
                self.reading = False
        except StopFetch:
            return None, None

    def _next(self, state) -> tuple[dict | None, Exception | None]:
        try:
            batch = None
            while batch is None:
                try:
                    batch, self.rng = next_batch(self.batches, self.rng)
                except StopIteration:
                    if state.consumed == 0:  # never loop forever on an epoch that yields nothing
                        rank, size = world()
                        if size > 1 and self.batch_sampler is None:  # the random stream: each rank reads its shards
                            n = self.data.n_train
                            shards = len(self.data.train.shards)
                            raise TrainError(
                                f"epoch {state.epoch} gave this process (rank {rank}) no batch of "
                                f"{self.batch_size}: each of the {size} reads its own shards of the {shards} (holding "
                                f"{n} training samples in all), and its shards hold fewer; write more, evenly "
                                "filled shards, or lower --batch-size or data.workers") from None
                        raise TrainError(f"epoch {state.epoch} gave no batch of {self.batch_size} from "
                                         f"{self.data.n_train} training samples; lower --batch-size or data.workers"
                                         ) from None
                    check_bad_samples(self.data.counts, True, self.data.use_features)
                    state.epoch, state.consumed = state.epoch + 1, 0
                    self._open(state.epoch)
                    continue
                if batch is None:  # every sample of this batch was undecodable (counted)
                    state.consumed += 1
            self.bad = check_bad_samples(self.data.counts, False, self.data.use_features)
            return batch, None
        except TrainError as e:
            return None, e
        except Exception as e:  # a loader worker's error (or the signal reaching a worker)
            return None, loader_error(e)
