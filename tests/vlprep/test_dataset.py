import io
import json
import os
import tarfile
from pathlib import Path

import pytest
import webdataset as wds

from tests.conftest import cli_in_process
from vlprep import VlprepError
from vlprep.dataset import ShardFormatError, iter_samples, iter_tar, open_dataset
from vlprep.shards import ShardsConfig, build_shards


def make_tar(path: Path, members: dict[str, bytes]) -> Path:
    with tarfile.open(path, "w") as tf:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))
    return path


@pytest.fixture
def dataset(image_folder, tmp_path) -> Path:
    build_shards(ShardsConfig(src=image_folder, out=tmp_path / "ds", samples_per_shard=5, workers=1))
    return tmp_path / "ds"


@pytest.mark.parametrize("bad", ["x.pyd", "x.pickle", "x.cls.pkl", "../x.txt", "a/../../x.txt", "/etc/x.txt"])
def test_reader_rejects_pickles_and_unsafe_names(tmp_path, bad):
    tar = make_tar(tmp_path / "s.tar", {"a.txt": b"fine", bad: b"payload"})
    with pytest.raises(ShardFormatError, match="refusing pickled|unsafe member"):
        list(iter_tar(tar))


def test_reader_skip_handler_keeps_going(tmp_path):
    tar = make_tar(tmp_path / "s.tar", {"a.txt": b"x", "b.pyd": b"p", "c.txt": b"y"})
    errors = []
    got = list(iter_tar(tar, handler=lambda e: errors.append(e) or True))
    assert [s["__key__"] for s in got] == ["a", "c"] and len(errors) == 1


def test_open_dataset_errors(tmp_path):
    with pytest.raises(VlprepError, match="dataset not found"):
        open_dataset(tmp_path / "nope")
    (tmp_path / "f").write_text("x")
    with pytest.raises(VlprepError, match="not a dataset folder"):
        open_dataset(tmp_path / "f")
    (tmp_path / "d").mkdir()
    with pytest.raises(VlprepError, match="not a shard dataset"):
        open_dataset(tmp_path / "d")
    (tmp_path / "d" / "sizes.json").write_text('{"gone.tar": 3}')
    with pytest.raises(VlprepError, match="missing, e.g. gone.tar"):
        open_dataset(tmp_path / "d")


def test_webdataset_reads_our_shards(dataset):
    urls = [str(dataset / s) for s in open_dataset(dataset).shards]
    got = list(wds.WebDataset(urls, shardshuffle=False).decode())
    ours = list(iter_samples(dataset))
    assert [s["__key__"] for s in got] == [s["__key__"] for s in ours]
    assert [s["txt"] for s in got] == [s["txt"] for s in ours]
    assert [s["json"] for s in got] == [s["json"] for s in ours]


def test_wids_reads_our_shards_through_index_json(dataset, tmp_path):
    import wids

    ds = wids.ShardListDataset(str(dataset / "index.json"), cache_dir=str(tmp_path / "cache"), transformations=[])
    ours = list(iter_samples(dataset, decode=False))
    assert len(ds) == len(ours) == 12
    for i in (0, 4, 5, 11):  # across shard boundaries
        s = ds[i]
        assert s["__key__"] == ours[i]["__key__"]
        for ext in ("txt", "json", "png" if "png" in ours[i] else "jpg"):
            assert s["." + ext].getvalue() == ours[i][ext]
    index = json.loads((dataset / "index.json").read_text())
    assert index["wids_version"] == 1 and [e["nsamples"] for e in index["shardlist"]] == [5, 5, 2]


def test_cli_user_errors_are_one_line(tmp_path, capfd):
    """`vlprep shards` run as its main() in this process (cli_in_process): the exit status and the one error line are
    a child's; an uncaught exception would raise here instead of printing a traceback, a failure either way."""
    r = cli_in_process(capfd, "shards", tmp_path / "nope.csv", tmp_path / "o")
    assert r.returncode == 2
    assert r.stderr.strip() == f"error: source not found: {tmp_path / 'nope.csv'}"
    (tmp_path / "t.csv").write_text("path,label\na.png,1\n")
    r = cli_in_process(capfd, "shards", tmp_path / "t.csv", tmp_path / "o")
    assert r.returncode == 2 and "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1
    assert "no caption column found" in r.stderr and "columns are: path, label" in r.stderr


def lock_is_free(out) -> bool:
    """Whether another writer could take OUT's lock now (flock conflicts across open files, even in one process)."""
    import fcntl

    fd = os.open(out / ".vlprep.lock", os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except OSError:
        return False
    finally:
        os.close(fd)


def test_writing_output_holds_the_lock_and_releases_it_when_the_stage_raises(tmp_path):
    from vlprep.output import Out, writing_output

    out = tmp_path / "out"
    with pytest.raises(RuntimeError, match="boom"):
        with writing_output(Out(out), "test", {"a": 1}):
            assert not lock_is_free(out)  # a second writer is refused while the stage runs
            raise RuntimeError("boom")
    assert lock_is_free(out)  # and may write once the stage has failed, while this process goes on
    with writing_output(Out(out), "test", {"a": 1}):  # the same options resume in the same process
        pass
    assert lock_is_free(out)


def test_the_output_side_keeps_no_registry_between_stages(image_folder, tmp_path):
    """Where a stage writes, the lock it holds and a remote input's mirror folder live in objects the stage is given
    (Out, Dataset): two stages run in one process leave every module-level container of vlprep's dataset, output,
    outlock, objstore and engine modules as it was."""
    from vlprep import dataset, engine, objstore, outlock, output
    from vlprep.bow import BowConfig, bow

    def containers() -> dict:
        return {(m.__name__, name): repr(value) for m in (dataset, output, outlock, objstore, engine)
                for name, value in vars(m).items() if isinstance(value, (dict, set, list))}

    before = containers()
    # the only module-level containers are constant tables (a URL scheme -> the package it needs, its alias)
    assert {name for _, name in before if not name.startswith("__")} == {"SCHEMES", "ALIASES"}
    build_shards(ShardsConfig(src=image_folder, out=tmp_path / "ds", samples_per_shard=5, workers=1))
    bow(BowConfig(src=tmp_path / "ds", out=tmp_path / "bow", ops="shuffle", workers=1))
    assert containers() == before
    assert lock_is_free(tmp_path / "ds") and lock_is_free(tmp_path / "bow")
