"""vlprep.objstore's rules that need no server: which faults are retried, how often and how long, URL arguments; and
vlprep.output's for a URL OUT: the staging folder, a stale lock. The servers are in tests/integration/test_objstore.py."""

import os
import socket
from pathlib import Path

import pytest

from vlprep import VlprepError, objstore, urls
from vlprep.cliargs import check_dataset


class Status(Exception):
    def __init__(self, status: int):
        super().__init__(f"status {status}")
        self.status = status


class BotoLike(Exception):
    """botocore's ClientError carries its HTTP status in .response."""

    def __init__(self, status: int):
        super().__init__("An error occurred")
        self.response = {"Error": {"Code": "X"}, "ResponseMetadata": {"HTTPStatusCode": status}}


def test_transient_faults_are_resets_timeouts_5xx_and_cut_bodies_never_404_or_403():
    for e in (ConnectionResetError(), TimeoutError(), BrokenPipeError(), Status(503), Status(500), Status(429),
              Status(408), BotoLike(503)):
        assert objstore.transient(e), e
    for e in (FileNotFoundError(), PermissionError(), Status(404), Status(403), BotoLike(404), ValueError("x"),
              KeyError("k")):
        assert not objstore.transient(e), e
    # fsspec's http info() raises FileNotFoundError for any failure: its cause decides
    wrapped = FileNotFoundError("http://h/x")
    wrapped.__cause__ = Status(503)
    assert objstore.transient(wrapped)
    wrapped.__cause__ = Status(404)
    assert not objstore.transient(wrapped)


def test_retried_tries_a_bounded_number_of_times_counts_each_retry_and_ends_in_one_line(monkeypatch):
    monkeypatch.setenv("VLPREP_REMOTE_TRIES", "4")
    monkeypatch.setenv("VLPREP_REMOTE_BACKOFF", "0")
    calls, retries = [], []

    def flaky():
        calls.append(1)
        if len(calls) < 3:
            raise ConnectionResetError("reset by peer")
        return "ok"

    assert objstore.retried("s3://b/x", flaky, lambda: retries.append(1)) == "ok"
    assert len(calls) == 3 and len(retries) == 2
    calls.clear()

    def broken():
        calls.append(1)
        raise ConnectionResetError("reset by peer\nsecond line")

    with pytest.raises(objstore.RemoteError) as e:
        objstore.retried("s3://b/x", broken)
    assert str(e.value) == "s3://b/x: cannot read it after 4 tries (ConnectionResetError: reset by peer)"
    assert len(calls) == 4
    with pytest.raises(objstore.RemoteNotFound, match=r"^s3://b/x: not found$"):
        objstore.retried("s3://b/x", lambda: (_ for _ in ()).throw(FileNotFoundError("b/x")))
    monkeypatch.setenv("VLPREP_REMOTE_BACKOFF", "0.5")
    assert [objstore.backoff(i) for i in range(6)] == [0.5, 1, 2, 4, 8, 8]


def test_dataset_arguments_take_urls_of_the_schemes_we_read_and_out_of_those_we_write():
    assert check_dataset("s3://b/ds/") == "s3://b/ds" and check_dataset("https://h/ds") == "https://h/ds"  # canonical
    assert check_dataset("file:///data/ds") == Path("/data/ds") and check_dataset("data/ds") == Path("data/ds")
    assert check_dataset("C:/data/ds") == Path("C:/data/ds")  # a drive letter is no scheme
    with pytest.raises(VlprepError, match=r"^SRC ftp://h/ds: unsupported URL scheme ftp://; use s3://, gs://, "):
        check_dataset("ftp://h/ds", "SRC")
    with pytest.raises(VlprepError, match=r"^OUT https://h/ds: https:// is read-only here; write to s3://, gs:// or "):
        check_dataset("https://h/ds", "OUT", out=True)
    with pytest.raises(VlprepError, match="names a local path"):
        urls.file_url_path("file://otherhost/data")


def test_a_url_out_is_written_in_a_staging_folder_that_names_it(tmp_path):
    from vlprep.dataset import Dataset
    from vlprep.output import Out, check_out, staging

    out = check_out("s3://bucket/bow/", tmp_path)
    assert out == Out(staging("s3://bucket/bow"), "s3://bucket/bow")
    assert check_out("gs://bucket/x", tmp_path).root != out.root
    with pytest.raises(VlprepError, match=r"^OUT https://h/x: https:// is read-only here"):
        check_out("https://h/x")
    # a remote input is compared by URL (an opened remote Dataset stands for its URL, not its mirror folder)
    mirror = Dataset(root=objstore.mirror(), shards=[], sizes={}, url="s3://bucket/raw")
    for out, says in (("s3://bucket/raw", "is the input"), ("s3://bucket", "contains the input"),
                      ("s3://bucket/raw/sub", "lies inside the input")):
        with pytest.raises(VlprepError, match=says):
            check_out(out, mirror)
    assert check_out("s3://bucket/raw2", mirror).url == "s3://bucket/raw2"


def test_a_lock_is_stale_only_when_its_holder_ran_here_and_is_gone():
    from vlprep.outlock import _stale, lock_record

    me = lock_record()
    assert not _stale(me)  # this process
    assert _stale({**me, "pid": 2 ** 22 + 1})  # no such process
    assert _stale({**me, "start": "1"})  # the pid is another process now
    assert not _stale({**me, "host": socket.gethostname() + "-other", "pid": 2 ** 22 + 1})  # can't tell
    assert me["pid"] == os.getpid() and len(me["token"]) == 32
