"""Dataset locations in one canonical form, compared before OUT may be written, and credentials never shown
(vlprep.urls): pure functions and check_out, no server."""

import os

import pytest

from tests.conftest import make_dataset
from vlprep import VlprepError, objstore, urls
from vlprep.dataset import Dataset
from vlprep.outlock import lock_url
from vlprep.output import check_out
from vlprep.cliargs import check_dataset


@pytest.mark.parametrize("given, canonical", [
    ("s3a://bkt/raw2", "s3://bkt/raw2"), ("s3n://bkt/raw2/", "s3://bkt/raw2"), ("S3://bkt/raw2//", "s3://bkt/raw2"),
    ("gcs://bkt/x", "gs://bkt/x"), ("s3://bkt/a/../raw2", "s3://bkt/raw2"), ("s3://bkt/./raw2/.", "s3://bkt/raw2"),
    ("s3://bkt/raw%32", "s3://bkt/raw2"), ("s3://bkt/%7Eme/a%2fb", "s3://bkt/~me/a%2Fb"), ("s3://bkt/", "s3://bkt"),
    ("HTTP://Host.Example:80/ds/", "http://host.example/ds"), ("https://h:443/a/../ds", "https://h/ds"),
    ("https://h:8443/ds", "https://h:8443/ds"), ("http://u:P@H/ds/?token=T", "http://u:P@h/ds?token=T"),
])
def test_every_spelling_of_a_location_has_one_canonical_form(given, canonical):
    assert urls.canonical(given) == canonical
    assert urls.canonical(canonical) == canonical  # idempotent: a canonical URL compares equal to itself


def test_a_local_folder_is_compared_by_its_resolved_path(tmp_path):
    (tmp_path / "a").mkdir()
    os.symlink(tmp_path / "a", tmp_path / "link")
    here = urls.place(tmp_path / "a")
    for spelling in (f"file://{tmp_path}/a", f"file://{tmp_path}/%61", f"{tmp_path}/a/../a", f"{tmp_path}/a/",
                     str(tmp_path / "link"), f"file://localhost{tmp_path}/a/"):
        assert urls.place(spelling) == here, spelling


@pytest.mark.parametrize("out, src, says", [
    ("s3a://bkt/raw2", "s3://bkt/raw2", "is the input"), ("s3://bkt/raw2/", "s3n://bkt/raw2", "is the input"),
    ("s3a://bkt/raw/x", "s3://bkt/raw", "lies inside the input"), ("s3://bkt/raw%32", "s3://bkt/raw2", "is the input"),
    ("s3://bkt/x/../raw2", "s3://bkt/raw2", "is the input"), ("s3://BKT/raw2", "s3://bkt/raw2", "is the input"),
    ("gcs://bkt/ds/sub", "gs://bkt/ds/", "lies inside the input"), ("s3a://bkt", "s3://bkt/raw", "contains the input"),
])
def test_a_url_out_that_aliases_a_remote_input_is_refused(out, src, says):
    """The input stands as vlprep's stages give it: an opened Dataset, which stands for its URL."""
    mirror = Dataset(root=objstore.mirror(), shards=[], sizes={}, url=objstore.norm(src))
    with pytest.raises(VlprepError, match=says):
        check_out(out, mirror)
    with pytest.raises(VlprepError, match=says):
        check_out(out, src)


def test_a_url_out_beside_its_input_is_taken():
    mirror = Dataset(root=objstore.mirror(), shards=[], sizes={}, url="s3://bkt/raw")
    assert check_out("s3a://bkt/raw2", mirror).url == "s3://bkt/raw2"
    assert check_out("s3://other/raw", mirror).url == "s3://other/raw"


def test_a_local_out_that_aliases_its_input_is_refused(tmp_path):
    src = make_dataset(tmp_path / "raw", ["a cat", "a dog"], per_shard=2)
    os.symlink(src, tmp_path / "link")
    for out, says in ((f"file://{src}", "is the input"), (f"{src}/../raw", "is the input"), (f"{src}/", "is the input"),
                      (f"file://{tmp_path}/%72aw/x", "lies inside the input"), (str(tmp_path / "link"), "is the input"),
                      (f"file://{tmp_path}/link/sub", "lies inside the input"), (f"file://{tmp_path}", "contains")):
        with pytest.raises(VlprepError, match=says):
            check_out(out, src)
        with pytest.raises(VlprepError, match=says):  # pseudolabel's inputs: each is compared
            check_out(out, tmp_path / "elsewhere", src)


@pytest.mark.parametrize("url, shown", [
    ("http://user:PW@h/feat/", "http://h/feat/"), ("https://u%40x:P%3Aw@h:8443/a", "https://h:8443/a"),
    ("http://h/feat/sizes.json?token=T0K", "http://h/feat/sizes.json?token=***"),
    ("https://h/a?X-Amz-Signature=S1G&X-Amz-Credential=C&page=2",
     "https://h/a?X-Amz-Signature=***&X-Amz-Credential=***&page=2"),
    ("https://h/a?sig=S&se=2030&sp=r", "https://h/a?sig=***&se=2030&sp=r"),
    ("https://h/a?api_key=K&password=P&access_token=A", "https://h/a?api_key=***&password=***&access_token=***"),
    ("s3://k:T@bkt/raw", "s3://bkt/raw"), ("/local/path", "/local/path"),
    ("https://h/a?jwt=J&pw=P&code=C&Bearer=B&page=2", "https://h/a?jwt=***&pw=***&code=***&Bearer=***&page=2"),
    ("https://h/a#access_token=F&state=s", "https://h/a#access_token=***&state=s"),  # an OAuth implicit-grant URL
])
def test_a_url_is_shown_without_its_credentials(url, shown):
    assert urls.redact(url) == shown
    assert urls.redact_text(f"error: {url}: cannot read it") == f"error: {shown}: cannot read it"


def test_a_query_string_stays_after_each_file_name():
    folder = objstore.norm("http://h/feat/?token=T")
    assert objstore.join(folder, "sizes.json") == "http://h/feat/sizes.json?token=T"
    assert objstore.join("https://u:p@h/ds?sig=S&se=1", "shard-000000.tar") == \
        "https://u:p@h/ds/shard-000000.tar?sig=S&se=1"


@pytest.mark.parametrize("url", ["s3://AKIAKEY:S3CRET@bkt/raw/", "gs://user:S3CRET@bkt/raw",
                                 "s3a://AKIAKEY:S3CRET@bkt/raw", "s3://bkt/raw?X-Amz-Security-Token=S3CRET"])
def test_credentials_in_an_s3_or_gs_url_are_one_line_that_does_not_echo_them(url):
    with pytest.raises(VlprepError) as e:
        check_dataset(url, "SRC")
    assert "S3CRET" not in str(e.value) and "AKIAKEY" not in str(e.value) and "\n" not in str(e.value)
    assert str(e.value).startswith("SRC ")


def test_missing_s3_credentials_are_one_line_at_once(monkeypatch):
    botocore = pytest.importorskip("botocore.exceptions")
    monkeypatch.setenv("VLPREP_REMOTE_BACKOFF", "0")
    calls = []

    def no_credentials():
        calls.append(1)
        raise botocore.NoCredentialsError()

    with pytest.raises(objstore.RemoteError, match=r"^s3://b/x: no credentials to read it .*AWS_ACCESS_KEY_ID"):
        objstore.retried("s3://b/x", no_credentials)
    assert len(calls) == 1


@pytest.mark.parametrize("body", [b"[1, 2]", b'"held"', b"7"])
def test_a_lock_object_that_is_not_a_record_is_one_line_saying_how_to_remove_it(body):
    fsspec = pytest.importorskip("fsspec")
    fs = fsspec.filesystem("memory")
    fs.pipe_file(f"/locks{body[:2].hex()}/out/.vlprep.lock", body)
    with pytest.raises(VlprepError, match=r"\.vlprep\.lock is not a vlprep lock .*delete it"):
        lock_url(f"memory://locks{body[:2].hex()}/out")
