"""Dataset folders' shards and counts, the key-hash split, the data signature, pixels or tokens."""

import hashlib
import json
from pathlib import Path

from vlprep import objstore
from vlprep.dataset import open_dataset


def in_val(key: str, frac: float) -> bool:
    """Held-out membership by key hash: the same samples whatever the seed, run or shard order."""
    h = hashlib.blake2b(f"val:{key}".encode(), digest_size=8).digest()
    return int.from_bytes(h, "big") < frac * 2**64


# Spec keys that must agree for two `vlprep features` datasets to be mixed (dtype may differ: same encoder).
SAME_ENCODER = ("encoder", "weights_sha256", "size", "mean", "std", "tokens", "dim")


def feature_input(folders, mode: str = "auto") -> dict | None:
    """The `vlprep features` record to train on (feature input), or None for pixel input; ValueError if mixed.

    mode "auto" takes features when every folder has them and pixels when none has; "pixels" ignores them;
    "features" requires them. Folders made by different encoders are never mixed.
    """
    from vlprep.encoders import features_spec

    specs = {str(f): features_spec(f) for f in folders}
    if mode == "pixels":
        return None
    have = [f for f, s in specs.items() if s]
    lack = [f for f, s in specs.items() if not s]
    if not have:
        if mode == "features":
            raise ValueError(f"data.input=features but {', '.join(lack)} holds no `vlprep features` tokens "
                             "(no 'features' record in meta.json); run `vlprep features` on it first")
        return None
    if lack:
        raise ValueError(f"cannot mix feature datasets ({', '.join(have)}) with pixel datasets ({', '.join(lack)}): "
                         "run `vlprep features` on the pixel ones, or train on pixels with --set data.input=pixels")
    first = specs[have[0]]
    for f in have[1:]:
        diff = [k for k in SAME_ENCODER if specs[f].get(k) != first.get(k)]
        if diff:
            k = diff[0]
            raise ValueError(f"{have[0]} and {f} hold features of different encoders ({k} {first.get(k)!r} vs "
                             f"{specs[f].get(k)!r}); make both with the same `vlprep features` options")
    return first


def shard_sizes(folders: list[str | Path]) -> dict[Path | str, int]:
    """Every shard of the given dataset folders (a path, or a URL for a remote folder) -> its sizes.json count,
    interleaved so that every folder is mixed from the start."""
    lists = [[(ds.tar(s), n) for s, n in ds.sizes.items()] for ds in map(open_dataset, folders)]
    out = {}
    for i in range(max((len(x) for x in lists), default=0)):
        out.update(x[i] for x in lists if i < len(x))
    return out


def first_held_out(folders, val_frac: float, limit: int) -> tuple[list, set]:
    """(the shards, in ShardStream's order, that hold the first `limit` held-out samples; those samples' keys), from
    the sidecars of those shards only: a capped evaluation reads the shards holding what it scores, whatever N."""
    lists = [[(ds, s) for s in ds.shards] for ds in map(open_dataset, folders)]
    order = [x[i] for i in range(max((len(x) for x in lists), default=0)) for x in lists if i < len(x)]
    shards = []
    keys = set()
    for ds, shard in order:
        if len(keys) >= limit:
            break
        held = [k for k in ds.column(shard, "key") if in_val(k, val_frac)]
        if held:
            shards.append(ds.tar(shard))
            keys.update(held[:limit - len(keys)])
    return shards, keys


def shard_paths(folders: list[str | Path]) -> list[Path]:
    return list(shard_sizes(folders))


def data_signature(folders: list[str | Path]) -> str:
    """What identifies the training data's contents, for `--resume` and for pipelines that reuse finished runs: a
    hash of each folder's sizes.json and every shard's Parquet sidecar (keys and captions), which vlprep rewrites
    when a shard's records change. Content, not mtimes: a stage re-run with the same result keeps the signature.
    A remote folder (a URL) is not read whole for it: its sizes.json, and each shard's tar and sidecar by their ETag
    (S3's and GCS's are content hashes for a plain upload) or, where the server gives none, their size."""
    h = hashlib.sha256()
    for folder in folders:
        ds = open_dataset(folder)
        h.update(b"\0" + json.dumps(ds.sizes, sort_keys=True).encode())
        if ds.url:
            for shard in ds.sizes:
                side = Path(shard).with_suffix(".parquet").name
                tar = ds.stat(shard)
                meta = (ds.listed or {}).get(side) or objstore.info(objstore.join(ds.url, side))
                h.update(json.dumps([shard, tar["etag"] or tar["size"], meta["etag"] or meta["size"]]).encode())
            continue
        for shard in ds.sizes:
            side = ds.root / Path(shard).with_suffix(".parquet")
            h.update(shard.encode() + (side.read_bytes() if side.is_file() else b"-"))
    return h.hexdigest()[:16]


def count_split(folders, val_frac: float) -> dict[str, int]:
    """Number of train / val samples, from the sidecars' keys (no tar reads)."""
    n = {"train": 0, "val": 0}
    for ds in map(open_dataset, folders):
        for shard in ds.shards:
            for key in ds.column(shard, "key"):
                n["val" if in_val(key, val_frac) else "train"] += 1
    return n
