"""Crafted and broken inputs, as a careless or hostile user gives them.

Each test reproduces the attack or the fault: a corrupt tar header, shard names that point outside OUT, an OUT
that overlaps its input, two writers on one OUT, too few samples for the loader workers, undecodable samples in
training, and duplicate uids.
"""

import json
import subprocess
import sys
import tarfile
import time
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest
from PIL import Image
from typer.testing import CliRunner

from tests.conftest import cli_in_process
from tests.leakguard import started_here
from vlprep import VlprepError
from vlprep.bow import BowConfig, bow
from vlprep.dataset import BadShardError, check_shards, open_dataset
from vlprep.output import Out, prepare_output
from vlprep.shards import ShardsConfig, build_shards, png_chunks_ok
from vltrain.cli import app
from vltrain.data.indexed import IndexedShards
from vltrain.data.stream import ShardStream

TINY = ["model.text_model=tiny", "model.image_model=tiny", "model.embed_dim=16", "data.image_size=32",
        "data.max_len=12", "log_every=1", "optim.warmup_steps=2", "optim.lr=0.01", "data.val_frac=0",
        "eval_every=1000"]


def png(seed: int, size: int = 20) -> bytes:
    import io

    buf = io.BytesIO()
    rng = np.random.default_rng(seed)
    Image.fromarray(rng.integers(0, 255, (size, size, 3)).astype(np.uint8)).save(buf, format="PNG")
    return buf.getvalue()


def cut_png(data: bytes) -> bytes:
    """A PNG cut in its pixel data with the IEND chunk put back: end-marker checks pass, decoding fails."""
    return data[: len(data) // 2] + data[-12:]


def short_idat_png(data: bytes) -> bytes:
    """A PNG whose compressed pixel data is cut, with every chunk length and CRC made valid again: it passes
    `vlprep shards`' chunk walk (as a file damaged before it was packaged would) and fails only when decoded."""
    import zlib

    out, pos = [data[:8]], 8
    while pos < len(data):
        length = int.from_bytes(data[pos:pos + 4], "big")
        kind, body = data[pos + 4:pos + 8], data[pos + 8:pos + 8 + length]
        if kind == b"IDAT":
            body = body[: len(body) // 2]
        out.append(len(body).to_bytes(4, "big") + kind + body + zlib.crc32(kind + body).to_bytes(4, "big"))
        pos += 12 + length
    return b"".join(out)


def image_folder(root: Path, n: int, bad: tuple[int, ...] = (), size: int = 20, damage=short_idat_png) -> Path:
    root.mkdir(parents=True)
    for i in range(n):
        data = png(i, size)
        (root / f"{i:03d}.png").write_bytes(damage(data) if i in bad else data)
        (root / f"{i:03d}.txt").write_text(f"a picture of thing {i} colour {i % 5}")
    return root


def make_ds(tmp: Path, n: int = 12, per: int = 4, name: str = "ds", **kw) -> Path:
    build_shards(ShardsConfig(src=image_folder(tmp / f"{name}-src", n, **kw), out=tmp / name,
                              samples_per_shard=per, workers=1))
    return tmp / name


def corrupt_header(tar: Path, member: int, seed: int = 1) -> None:
    """512 random bytes over the header of the given member (tarfile then takes it for the end of the archive)."""
    with tarfile.open(tar) as tf:
        offset = tf.getmembers()[member].offset
    data = bytearray(tar.read_bytes())
    data[offset:offset + 512] = np.random.default_rng(seed).integers(0, 256, 512, dtype=np.uint8).tobytes()
    tar.write_bytes(bytes(data))


def one_line(text: str) -> str:
    lines = [ln for ln in text.splitlines() if ln.strip()]
    assert len(lines) == 1, text
    return lines[0]


@pytest.fixture
def vlprep_cli(capfd):
    """vlprep_cli(*ARGS): `vlprep ARGS` as its main() in this process (tests/conftest.py's cli_in_process): the exit
    status and what reaches stderr are a child's, without a fresh interpreter's imports per run."""
    return lambda *args: cli_in_process(capfd, *args)


def vltrain_run(shards, out, *args):
    return CliRunner().invoke(app, ["run", *map(str, shards if isinstance(shards, list) else [shards]), "--out",
                                    str(out), "--device", "cpu", "--preset", "clip",
                                    *[x for s in TINY for x in ("--set", s)], *args])


# --- 2. a corrupt tar header no longer truncates a shard silently ------------------------------------------------


@pytest.fixture
def damaged(tmp_path) -> Path:
    """12 samples in 3 shards of 4; the header of the second sample of shard 1 is overwritten (the tar ends there)."""
    ds = make_ds(tmp_path)
    corrupt_header(ds / "shard-000001.tar", member=3)  # members: png, json, txt per sample
    return ds


@pytest.mark.parametrize("workers", [1, 2])
def test_short_shard_stops_bow_naming_it_and_both_counts(damaged, tmp_path, workers):
    out = tmp_path / "bow"
    with pytest.raises(BadShardError) as e:
        bow(BowConfig(src=damaged, out=out, ops="shuffle", workers=workers))
    msg = one_line(str(e.value))
    assert "shard-000001.tar" in msg and "holds 1 samples, its sidecar lists 4" in msg
    assert "--skip-bad-shards" in msg
    assert not (out / "shard-000001.tar").exists() and not (out / "sizes.json").exists()
    if workers == 1:  # the shard before it was finished and stays: a re-run resumes from it
        assert (out / "shard-000000.tar").exists()


def test_skip_bad_shards_leaves_it_out_counted_and_reported(damaged, tmp_path, vlprep_cli):
    out = tmp_path / "bow"
    r = vlprep_cli("bow", str(damaged), str(out), "--ops", "shuffle", "--workers", "1", "--skip-bad-shards")
    assert r.returncode == 0, r.stderr
    assert "warning: left out bad shard shard-000001.tar: the tar holds 1 samples, its sidecar lists 4, " \
           "sizes.json says 4" in " ".join(r.stderr.split())
    report = json.loads((out / "report.json").read_text())
    assert list(report["bad_shards"]) == ["shard-000001.tar"] and report["samples_in"] == 8
    assert json.loads((out / "sizes.json").read_text()) == {"shard-000000.tar": 4, "shard-000002.tar": 4}
    assert [len(list(tarfile.open(out / s))) for s in ("shard-000000.tar", "shard-000002.tar")] == [12, 12]


def test_check_shards_against_a_counted_rederivation(damaged):
    ds = check_shards(open_dataset(damaged))
    with tarfile.open(damaged / "shard-000001.tar") as tf:  # what tarfile can still read, grouped by key by hand
        readable = len({m.name.split(".")[0] for m in tf.getmembers()})
    assert readable == 1
    assert ds.shards == ["shard-000000.tar", "shard-000002.tar"]
    assert "holds 1 samples" in ds.bad["shard-000001.tar"]


def test_training_loaders_refuse_a_short_shard(damaged, tmp_path):
    with pytest.raises(BadShardError, match="shard-000001.tar: the tar holds 1 samples, sizes.json says 4"):
        list(ShardStream([damaged], "train", 0.0, None, shuffle=False))
    shards = IndexedShards([damaged])
    assert shards.raw(0)["__key__"] == "shard_000000000"
    with pytest.raises(BadShardError, match="shard-000001.tar"):
        shards.raw(5)


def test_worker_error_reaches_the_user_as_one_line(damaged, tmp_path):
    """...and the failed run's loader workers are stopped with it. Before: the traceback that CliRunner keeps (as a
    Python session would) held the loader, and its two workers ran on after the run had failed."""
    before = started_here()
    r = vltrain_run(damaged, tmp_path / "run", "--batch-size", "2", "--steps", "20", "--set", "data.workers=2")
    assert r.exit_code == 2, r.output
    errors = [ln for ln in r.output.splitlines() if ln.startswith("error: ")]
    assert len(errors) == 1 and "shard-000001.tar: the tar holds 1 samples, sizes.json says 4" in errors[0]
    assert "Traceback" not in r.output and "DataLoader worker" not in r.output
    assert r.exception is not None and started_here() - before == set()  # stopped before train() returned


# --- 3. shard names in sizes.json / index.json cannot point outside the folder -------------------------------------


@pytest.mark.parametrize("name", ["../elsewhere/shard-000000.tar", "/tmp/abs/shard-000000.tar", "sub/shard.tar",
                                  ".hidden.tar", "shard-000000.parquet"])
def test_sizes_json_names_must_be_plain_tar_file_names(tmp_path, name):
    ds = make_ds(tmp_path, n=4)
    victim = tmp_path / "elsewhere" / "shard-000000.tar"
    victim.parent.mkdir()
    victim.write_bytes(b"precious")
    (ds / "sizes.json").write_text(json.dumps({name: 4}))
    with pytest.raises(VlprepError, match="is not a plain .tar file name"):
        bow(BowConfig(src=ds, out=tmp_path / "out" / "bow", ops="shuffle", workers=1))
    assert victim.read_bytes() == b"precious"


def test_index_json_must_match_sizes_json(tmp_path):
    ds = make_ds(tmp_path, n=8)
    index = json.loads((ds / "index.json").read_text())
    index["shardlist"][0]["url"] = "../other/shard-000000.tar"
    (ds / "index.json").write_text(json.dumps(index))
    with pytest.raises(VlprepError, match="is not a plain .tar file name"):
        IndexedShards([ds])
    index["shardlist"][0]["url"] = "shard-000000.tar"
    index["shardlist"][0]["nsamples"] = 3
    (ds / "index.json").write_text(json.dumps(index))
    with pytest.raises(VlprepError, match="index.json and sizes.json list different shards or counts"):
        IndexedShards([ds])


# --- 4. OUT never equals, contains or lies inside an input --------------------------------------------------------


def test_shards_refuses_its_own_image_folder_as_out(tmp_path):
    src = image_folder(tmp_path / "imgs", 4)
    before = sorted(p.name for p in src.iterdir())
    for out in (src, src / "shards", tmp_path):
        with pytest.raises(VlprepError, match="OUT .* (is the input|lies inside the input|contains the input)"):
            build_shards(ShardsConfig(src=src, out=out, workers=1, overwrite=True))
    assert sorted(p.name for p in src.iterdir()) == before


def test_derived_stage_refuses_overlapping_out_and_keeps_the_input(tmp_path):
    ds = make_ds(tmp_path, n=8)
    tars = sorted(p.name for p in ds.glob("*.tar"))
    for out, why in ((ds, "is the input"), (ds / "bow", "lies inside the input"), (tmp_path, "contains the input")):
        with pytest.raises(VlprepError, match=why):
            bow(BowConfig(src=ds, out=out, ops="shuffle", workers=1, overwrite=True))
    with pytest.raises(VlprepError, match="is the input"):  # re-sharding a dataset into itself
        build_shards(ShardsConfig(src=ds, out=ds, workers=1, overwrite=True))
    assert sorted(p.name for p in ds.glob("*.tar")) == tars


def test_overwrite_never_clears_a_folder_vlprep_did_not_write(tmp_path):
    ds = make_ds(tmp_path, n=4)
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.json").write_text("{}")
    (mine / "photo.png").write_bytes(png(0))
    with pytest.raises(VlprepError, match="not empty and was not written by vlprep"):
        bow(BowConfig(src=ds, out=mine, ops="shuffle", workers=1, overwrite=True))
    assert sorted(p.name for p in mine.iterdir()) == ["notes.json", "photo.png"]


# --- 5. two writers on one OUT ---------------------------------------------------------------------------------------


@contextmanager
def lock_held_elsewhere(out: Path, tool: str = "vlprep"):
    """Another process holding OUT's lock (as a running stage or training run does) until the block ends."""
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time; from pathlib import Path; "
                               "from vlprep.outlock import lock_output; "
                               "lock_output(Path(sys.argv[1]), sys.argv[2]); print('locked', flush=True); "
                               "time.sleep(60)", str(out), tool], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        yield holder
    finally:
        holder.kill()
        holder.wait()


def test_second_writer_is_refused_and_leaves_the_first_ones_files(tmp_path):
    ds = make_ds(tmp_path, n=4)
    out = tmp_path / "bow"
    with lock_held_elsewhere(out) as holder:
        (out / "shard-000000.tar.tmp").write_bytes(b"half written by the first writer")
        with pytest.raises(VlprepError) as e:
            bow(BowConfig(src=ds, out=out, ops="shuffle", workers=1))
        assert one_line(str(e.value)).startswith(f"OUT {out} is being written by another vlprep process "
                                                 f"(pid {holder.pid})")
        assert (out / "shard-000000.tar.tmp").exists()
    # the kernel released the lock with the process: the next run removes the stale .tmp and finishes
    report = bow(BowConfig(src=ds, out=out, ops="shuffle", workers=1, overwrite=True))
    assert report["written"] == 4 and not list(out.glob("*.tmp"))


def test_lock_is_reentrant_within_a_process(tmp_path):
    out = tmp_path / "o"
    prepare_output(Out(out), "x", {"a": 1})
    prepare_output(Out(out), "x", {"a": 1})  # a library user running a stage twice in one process


# --- 6. training-time faults ------------------------------------------------------------------------------------------


def test_few_samples_for_the_workers_never_hang(tmp_path):
    """10 samples in shards of 4/4/2, batch 8, 2 workers: each worker's shards can hold fewer than 8 samples."""
    ds = make_ds(tmp_path, n=10, per=4)
    t0 = time.monotonic()
    r = vltrain_run(ds, tmp_path / "run", "--batch-size", "8", "--steps", "3", "--set", "data.workers=2")
    assert r.exit_code == 0, r.output
    assert "warning: data.workers 2 -> 1: 10 training samples fill fewer than one batch of 8 per worker" in r.output
    assert time.monotonic() - t0 < 120


def test_undecodable_samples_are_skipped_counted_and_logged(tmp_path):
    ds = make_ds(tmp_path, n=120, per=40, bad=(7,))
    assert json.loads((ds / "report.json").read_text())["written"] == 120  # it passed `vlprep shards` (no decode)
    r = vltrain_run(ds, tmp_path / "run", "--batch-size", "8", "--steps", "16", "--set", "data.workers=0")
    assert r.exit_code == 0, r.output
    rows = [json.loads(ln) for ln in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    bad = [row["bad_samples"] for row in rows if "bad_samples" in row]
    assert bad[-1] == 1 and bad == sorted(bad)


def test_more_than_one_percent_undecodable_stops_with_one_line(tmp_path):
    ds = make_ds(tmp_path, n=40, per=20, bad=(3, 11, 30))
    r = vltrain_run(ds, tmp_path / "run", "--batch-size", "8", "--steps", "50", "--set", "data.workers=0")
    assert r.exit_code == 2, r.output
    err = [ln for ln in r.output.splitlines() if ln.startswith("error: ")]
    assert len(err) == 1 and err[0].startswith("error: 3 of 40 samples read could not be decoded (7.5%, more than 1%)")
    assert "Traceback" not in r.output


def test_index_sampler_drops_undecodable_samples_from_the_batch(tmp_path):
    ds = make_ds(tmp_path, n=120, per=40, bad=(5,))
    r = vltrain_run(ds, tmp_path / "run", "--batch-size", "8", "--steps", "15", "--set", "data.workers=0",
                    "--set", "sampler.kind=grit")
    assert r.exit_code == 0, r.output
    rows = [json.loads(ln) for ln in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["step"] == 15 and rows[-1]["bad_samples"] == 1  # one epoch: every sample was read once


def test_png_chunk_walk_catches_a_cut_png_that_keeps_iend(tmp_path):
    good = png(0, 40)
    cut = cut_png(good)
    assert cut.endswith(b"IEND\xaeB`\x82")
    assert png_chunks_ok(good) and not png_chunks_ok(cut)
    flipped = bytearray(good)
    flipped[20] ^= 0xFF  # one byte inside IHDR: its CRC no longer matches
    assert not png_chunks_ok(bytes(flipped))
    flipped = bytearray(good)
    flipped[60] ^= 0xFF  # one byte inside IDAT data: the default walk skips IDAT's CRC, --decode-check's does not
    assert png_chunks_ok(bytes(flipped)) and not png_chunks_ok(bytes(flipped), idat_crc=True)
    # the re-derivation: Pillow, decoding fully, agrees on both
    import io

    Image.open(io.BytesIO(good)).load()
    with pytest.raises((OSError, SyntaxError, ValueError)):
        Image.open(io.BytesIO(cut)).load()


def test_vlprep_shards_counts_a_cut_png_by_default(tmp_path):
    src = image_folder(tmp_path / "imgs", 6, bad=(2,), size=40, damage=cut_png)
    report = build_shards(ShardsConfig(src=src, out=tmp_path / "ds", workers=1))
    assert report["written"] == 5 and report["skipped"] == {"truncated_image": 1}
    # a PNG damaged inside valid chunks is found only by decoding: --decode-check
    src = image_folder(tmp_path / "imgs2", 6, bad=(2,), size=40)
    assert build_shards(ShardsConfig(src=src, out=tmp_path / "ds2", workers=1))["written"] == 6
    report = build_shards(ShardsConfig(src=src, out=tmp_path / "ds3", workers=1, decode_check=True))
    assert report["written"] == 5 and report["skipped"] == {"truncated_image": 1}


# --- 7. duplicate uids -----------------------------------------------------------------------------------------------


def test_duplicate_uids_are_kept_counted_and_warned(tmp_path, vlprep_cli):
    import pyarrow as pa
    import pyarrow.parquet as pq

    src = image_folder(tmp_path / "imgs", 12)
    rows = [{"image": str(src / f"{i:03d}.png"), "caption": f"thing {i}", "uid": "same" if i < 10 else f"u{i}"}
            for i in range(12)]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "t.parquet")
    r = vlprep_cli("shards", str(tmp_path / "t.parquet"), str(tmp_path / "ds"), "--workers", "1")
    assert r.returncode == 0, r.stderr
    report = json.loads((tmp_path / "ds" / "report.json").read_text())
    assert report["written"] == 12 and report["duplicate_uids"] == 9 and report["duplicate_uid_examples"] == ["same"]
    assert "warning: 9 written samples repeat an earlier uid (e.g. same)" in " ".join(r.stderr.split())


def test_second_training_run_on_one_out_is_refused(tmp_path):
    ds = make_ds(tmp_path, n=8)
    out = tmp_path / "run"
    with lock_held_elsewhere(out, "vltrain") as holder:
        r = vltrain_run(ds, out, "--batch-size", "4", "--steps", "2", "--set", "data.workers=0")
        assert r.exit_code == 2
        assert one_line(r.output) == (f"error: OUT {out} is being written by another vltrain process "
                                      f"(pid {holder.pid}); wait for it to finish or choose another folder")


def test_iter_tar_refuses_exactly_the_names_check_member_refuses(tmp_path):
    """iter_tar inlines _check_member's tests with a cheap pre-test; both must refuse the same member names."""
    import io
    import itertools
    import tarfile as tf_

    from vlprep.dataset import ShardFormatError, _check_member, iter_tar

    parts = ["", "a", "..", ".", "pyd", "x.pyd", "x.PKL", "x.pickle.txt", "x.txt.pyd", "abc.", "a/b", "y.Pickle"]
    names = {n for a, b in itertools.product(parts, repeat=2) for n in (a + b, f"{a}/{b}", f"/{a}{b}")
             if n and not n.endswith("/")}
    for i, name in enumerate(sorted(names)):
        path = tmp_path / f"{i}.tar"
        with tf_.open(path, "w", format=tf_.USTAR_FORMAT) as t:
            info = tf_.TarInfo(name)
            info.size = 1
            t.addfile(info, io.BytesIO(b"x"))
        try:
            _check_member(name)
            refused = False
        except ShardFormatError:
            refused = True
        if refused:
            with pytest.raises(ShardFormatError):
                list(iter_tar(path))
        else:
            list(iter_tar(path))
