"""`vlprep filter --phash D`: perceptual-hash near duplicates, and --exclude's pHash matches with eval images.

docs/FILTER.md is the contract. The scan pass (vlprep.filterscan) stores each decoded image's 64-bit pHash; the
driver holds those 8 bytes per sample and finds the pairs within Hamming distance D with FAISS' exact binary index,
a batch of queries at a time, then applies the same greedy rule as --near-dup (vlprep.filtervec.greedy).
"""

import numpy as np

from vlprep import VlprepError
from vlprep.filterscan import read_scan
from vlprep.filtervec import QUERY_BATCH, greedy, places

MAX_DISTANCE = 32  # half of the 64 bits: farther apart than two unrelated images' hashes are on average
PAIRS_SHOWN = 24


def check_distance(distance) -> None:
    """A one-line error unless --phash is an integer Hamming distance in 0..32."""
    if isinstance(distance, bool) or not isinstance(distance, (int, np.integer)) or not 0 <= distance <= MAX_DISTANCE:
        raise VlprepError(f"--phash is a Hamming distance between 64-bit pHashes, an integer in 0..{MAX_DISTANCE}; "
                          f"got {distance!r}")


def codes(hashes: np.ndarray) -> np.ndarray:
    """64-bit hashes as FAISS binary codes, (n, 8) uint8 (any fixed byte order keeps Hamming distances)."""
    return np.ascontiguousarray(hashes, dtype=np.uint64).view(np.uint8).reshape(-1, 8)


def binary_index(hashes: np.ndarray):
    """An exact FAISS binary index over 64-bit hashes, added a batch at a time."""
    import faiss

    # IndexBinaryFlat compares the query with every code: exact for any radius. IndexBinaryHash and
    # IndexBinaryMultiHash also have range_search, but they look only in the buckets within nflip bits of the
    # query's hashed prefix(es), so they miss pairs unless nflip covers the radius, and then the buckets they visit
    # grow combinatorially with it.
    index = faiss.IndexBinaryFlat(64)
    for s in range(0, len(hashes), QUERY_BATCH):
        index.add(codes(hashes[s:s + QUERY_BATCH]))
    return index


def hamming_hits(index, hashes: np.ndarray, distance: int):
    """Per batch of QUERY_BATCH query positions (hashes[j] is position j's): (query position, index id,
    -Hamming distance: higher is nearer) of every pair within `distance`."""
    for s in range(0, len(hashes), QUERY_BATCH):
        # FAISS' binary range search keeps distances below the radius: D + 1 keeps those <= D
        lims, dist, ids = index.range_search(codes(hashes[s:s + QUERY_BATCH]), distance + 1)
        owner = s + np.repeat(np.arange(len(lims) - 1), np.diff(lims).astype(np.int64))
        yield owner, ids.astype(np.int64), -np.rint(dist).astype(np.int64)


def phash_greedy(hashes: np.ndarray, distance: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The greedy rule over positions 0..n-1: j is dropped when an earlier KEPT i has Hamming distance <= distance.
    Returns (dropped positions, ascending; the nearest such i, the earliest on equal distances; the distance)."""
    if not len(hashes):
        return np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(0, np.int64)
    dropped, partner, score = greedy(len(hashes), hamming_hits(binary_index(hashes), hashes, distance))
    return dropped, partner, (-score).astype(np.int64)


def alive_hashes(d) -> tuple[np.ndarray, np.ndarray]:
    """The pHashes of the samples every earlier rule kept, in dataset order, and each shard's first position."""
    parts = [h[c == 0] for h, c in zip(d.h64["phash"], d.codes)]
    starts = np.concatenate([[0], np.cumsum([len(p) for p in parts])]).astype(np.int64)
    return (np.concatenate(parts) if parts else np.zeros(0, np.uint64)), starts


def keys_at(d, starts: np.ndarray, positions: np.ndarray) -> dict[int, str]:
    """{position: key} of sorted alive positions, each shard's scan keys read once."""
    found = {}
    table = None
    shard = -1
    for (i, r), j in zip(places(d, starts, positions), positions.tolist()):
        if i != shard:
            table = read_scan(d.out, d.shards[i], ["key"]).column(0)
            shard = i
        found[j] = table[r].as_py()
    return found


class PHash:
    """--phash D: a sample whose pHash is within Hamming distance D of an earlier kept sample's is dropped."""

    name = "phash"
    scan = ("phash",)
    hold = ("phash",)  # the driver's 8 bytes per sample

    def __init__(self, distance: int):
        self.distance = distance
        self.pairs: list[tuple[str, str, int]] = []  # (dropped key, kept key, distance): the report's first ones

    def run(self, d, code: int) -> None:
        hashes, starts = alive_hashes(d)
        dropped, partner, dist = phash_greedy(hashes, self.distance)
        del hashes
        keys = keys_at(d, starts, np.union1d(dropped, partner))  # named before any drop: places() reads the codes
        for (i, r), j, p, h in zip(list(places(d, starts, dropped)), dropped.tolist(), partner.tolist(),
                                   dist.tolist()):
            d.codes[i][r] = code
            d.details[(i, r)] = {"detail": f"phash distance {h} with {keys[p]}", "match_key": keys[p],
                                 "distance": h}
            if len(self.pairs) < PAIRS_SHOWN:
                self.pairs.append((keys[j], keys[p], h))


def eval_matches(d, evals: list[tuple[np.ndarray, list[str]]], distance: int) -> list[tuple]:
    """The samples still kept within `distance` of an eval image's pHash: per sample, in dataset order,
    ((shard index, row), key, eval set, eval key, distance) of the nearest eval image (the earliest on ties)."""
    hashes, starts = alive_hashes(d)
    best: dict[int, tuple[int, int, int]] = {}  # alive position -> (distance, eval set, eval row)
    for e, (eval_hashes, _) in enumerate(evals):
        if not len(eval_hashes) or not len(hashes):
            continue
        index = binary_index(eval_hashes)
        for owner, ids, score in hamming_hits(index, hashes, distance):
            for j, k, h in zip(owner.tolist(), ids.tolist(), (-score).tolist()):
                best[j] = min(best.get(j, (h, e, k)), (h, e, k))
    positions = np.array(sorted(best), np.int64)
    keys = keys_at(d, starts, positions)
    return [((i, r), keys[j], best[j][1], evals[best[j][1]][1][best[j][2]], best[j][0])
            for (i, r), j in zip(list(places(d, starts, positions)), positions.tolist())]
