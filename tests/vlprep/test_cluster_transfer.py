"""What travels between the driver and workers on other machines, without a server (the cluster itself is
tests/integration/test_cluster_noshare.py): pseudolabel's index fetched from a URL OUT once per machine, a file
uploaded early not uploaded again, and a Ray cluster that wants a token named as the cause in one line."""

import shutil
from pathlib import Path

import pytest

from vlprep import VlprepError, engine, knn, objstore
from vlprep.output import Out, _upload_rest, publish
from vlprep.pseudolabel import fetch_index

URL = "s3://bkt/out"


@pytest.fixture
def remote(tmp_path, monkeypatch):
    """A folder standing for the bucket: objstore's get/put/listing read and write it, and count what they did."""
    bucket = tmp_path / "bucket"
    bucket.mkdir()
    done = {"get": [], "put": []}

    def name(url: str) -> str:
        assert url.startswith(URL + "/"), url
        return url[len(URL) + 1:]

    def get_file(url, local, on_retry=None):
        if not (bucket / name(url)).exists():
            raise objstore.RemoteNotFound(url)
        done["get"].append(name(url))
        shutil.copyfile(bucket / name(url), local)

    def put_file(local, url):
        done["put"].append(name(url))
        shutil.copyfile(local, bucket / name(url))

    monkeypatch.setattr(objstore, "get_file", get_file)
    monkeypatch.setattr(objstore, "put_file", put_file)
    monkeypatch.setattr(objstore, "listing", lambda url: {p.name: {"type": "file"} for p in bucket.iterdir()})
    return bucket, done


def index_files(folder: Path, fp: str) -> None:
    """Stand-ins for OUT's index files, each holding its name and the fingerprint; the vocabulary as knn writes it."""
    folder.mkdir(parents=True, exist_ok=True)
    for name in knn.INDEX_FILES[:-1]:
        (folder / name).write_text(f"{name} {fp}")
    (folder / knn.VOCAB).write_text(f'{{"fingerprint": "{fp}", "words": [], "df": []}}')


def test_a_worker_elsewhere_fetches_the_index_once_and_again_only_when_it_changed(tmp_path, remote):
    bucket, done = remote
    index_files(bucket, "fp1")
    node = Out(tmp_path / "node" / "staging", URL)  # a worker's own staging folder, on a machine without the files
    fetch_index(node, "fp1")
    assert done["get"] == list(knn.INDEX_FILES) and done["get"][-1] == knn.VOCAB  # the fingerprint's file last
    assert all((node.root / n).read_bytes() == (bucket / n).read_bytes() for n in knn.INDEX_FILES)
    fetch_index(node, "fp1")  # the machine's next worker (or the next run with the same index) reuses them
    assert len(done["get"]) == len(knn.INDEX_FILES)
    index_files(bucket, "fp2")  # another index in OUT: the stale copy is replaced
    fetch_index(node, "fp2")
    assert done["get"][len(knn.INDEX_FILES):] == list(knn.INDEX_FILES)
    assert (node.root / "knn.faiss").read_text() == "knn.faiss fp2"
    assert not list(node.root.glob("*.tmp"))
    with pytest.raises(VlprepError, match="its caption index is not the one this run built"):
        fetch_index(node, "fp3")  # OUT holds fp2's: one line, not a worker reading another run's index
    local = Out(tmp_path / "local")  # a local OUT is where the driver built them: nothing is fetched
    fetch_index(local, "fp1")
    assert not local.root.exists()


def test_a_file_published_and_kept_is_not_uploaded_again_unless_it_changed(tmp_path, remote):
    bucket, done = remote
    out = Out(tmp_path / "staging", URL)
    out.root.mkdir()
    index_files(out.root, "fp")
    publish(out, knn.INDEX_FILES, keep=knn.INDEX_FILES)
    assert done["put"] == list(knn.INDEX_FILES)
    (out.root / "report.json").write_text("{}")
    _upload_rest(out)
    assert done["put"][len(knn.INDEX_FILES):] == ["report.json"]
    (out.root / knn.WORD_IDS).write_text("changed after its upload")
    _upload_rest(out)
    assert knn.WORD_IDS in done["put"][len(knn.INDEX_FILES) + 1:]
    assert (bucket / knn.WORD_IDS).read_text() == "changed after its upload"


def test_a_cluster_that_wants_a_token_is_one_line_naming_the_cause_and_the_fix(monkeypatch):
    ray = pytest.importorskip("ray")
    from ray.exceptions import AuthenticationError

    def refused(**kw):  # what ray.init (2.60) raises for a `ray start` cluster when the driver has no token
        try:
            raise AuthenticationError("RPC error: InvalidAuthToken: Authentication token is missing or incorrect")
        except AuthenticationError as cause:
            raise ConnectionError("Failed to connect to Ray cluster at 192.0.2.2:6379") from cause

    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", refused)
    monkeypatch.setattr(engine, "_probe_ray_address", lambda address: None)
    monkeypatch.setenv("RAY_ADDRESS", "127.0.0.1:6379")
    with pytest.raises(VlprepError) as e:
        engine.ray_connect()
    assert str(e.value) == (
        "cannot connect to the Ray cluster at RAY_ADDRESS=127.0.0.1:6379: it uses token authentication and this "
        "driver's token is missing or wrong; copy the cluster's token into ~/.ray/auth_token (or set RAY_AUTH_TOKEN) "
        "and set RAY_AUTH_MODE=token")

    def other(**kw):
        raise ConnectionError("Failed to connect to Ray cluster at 192.0.2.2:6379")

    monkeypatch.setattr(ray, "init", other)  # any other failure keeps its own line
    with pytest.raises(VlprepError, match=r"^cannot connect to the Ray cluster at RAY_ADDRESS=127.0.0.1:6379 "
                                          r"\(ConnectionError: Failed to connect"):
        engine.ray_connect()
