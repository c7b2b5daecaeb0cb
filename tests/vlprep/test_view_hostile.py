"""vlprep view and --serve against a hostile dataset: links out of it (figures, JSON files, a planted view folder),
locations its meta.json names (never opened; --input and --aligned are the user's), links and foreign Host headers
on --serve, and JSON nested 100,000 deep."""

import contextlib
import functools
import http.client
import http.server
import io
import json
import tarfile
import threading
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tests.conftest import image_bytes, make_dataset
from tests.vlprep.test_cli_bounds import error_line
from tests.vlprep.test_view import page_data
from vlprep import VlprepError
from vlprep.view import ViewConfig, build_view, make_server

SECRET = "AWS_SECRET_ACCESS_KEY=fake-secret-1234"
DEEP = b'{"a":' * 100_000 + b"1" + b"}" * 100_000


def hand_dataset(folder: Path, samples: list[tuple[str, str, bytes | None]], meta: dict | bytes) -> Path:
    """A one-shard dataset written by hand: (key, caption, json member or None) per sample, and its meta.json."""
    folder.mkdir()
    with tarfile.open(folder / "x-000000.tar", "w") as tar:
        for i, (key, caption, member) in enumerate(samples):
            parts = [("png", image_bytes(8, 8, seed=i)), ("txt", caption.encode())]
            for ext, data in parts + ([("json", member)] if member is not None else []):
                info = tarfile.TarInfo(f"{key}.{ext}")
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    (folder / "sizes.json").write_text(json.dumps({"x-000000.tar": len(samples)}))
    (folder / "meta.json").write_bytes(meta if isinstance(meta, bytes) else json.dumps(meta).encode())
    return folder


def write_dropped(ds: Path, rows: list[tuple[str, str]]) -> None:
    """A filter's dropped.parquet naming (key, shard) rows of its input, all dropped by caption_words."""
    pq.write_table(pa.table({"key": [k for k, _ in rows], "shard": [s for _, s in rows],
                             "rule": ["caption_words"] * len(rows), "detail": ["2 words, outside 3:"] * len(rows)}),
                   ds / "dropped.parquet")


def everything_in(folder: Path) -> str:
    """Every file under `folder`, read as text: what a secret would have to be absent from."""
    return "".join(p.read_bytes().decode("latin-1") for p in folder.rglob("*") if p.is_file())


@contextlib.contextmanager
def serving(out: Path):
    """The port of make_server(out) answering in a thread until the block ends."""
    server = make_server(out, 0)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.1})
    thread.start()
    try:
        yield server.server_address[1]
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


def get(port: int, path: str, host: str | None) -> tuple[int, bytes]:
    """(status, body) of GET `path` sent with the Host header `host` (None: no Host header at all)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        conn.putrequest("GET", path, skip_host=True, skip_accept_encoding=True)
        if host is not None:
            conn.putheader("Host", host)
        conn.endheaders()
        r = conn.getresponse()
        return r.status, r.read()
    finally:
        conn.close()


# --- 1. figures: regular files of the dataset only --------------------------------------------------------------------


@pytest.mark.parametrize("stats_link", ["file", "folder"])
def test_linked_figures_are_not_copied_listed_or_served(tmp_path, stats_link):
    ds = make_dataset(tmp_path / "ds", ["a dog", "a cat"], per_shard=2)
    private = tmp_path / "private"
    private.mkdir()
    (private / "stats.png").write_text(SECRET)
    real = image_bytes(8, 8)
    (ds / "clip_score.png").write_bytes(real)
    (ds / "env.png").symlink_to(private / "stats.png")
    (ds / "pw.png").symlink_to("/etc/passwd")
    if stats_link == "file":
        (ds / "stats").mkdir()
        (ds / "stats" / "stats.png").symlink_to(private / "stats.png")
    else:
        (ds / "stats").symlink_to(private)
    out = tmp_path / "out"
    report = build_view(ViewConfig(dataset=ds, out=out, samples=2))
    info = page_data(out)["info"]
    assert info["figures"] == [{"src": "figures/clip_score.png", "name": "clip_score.png"}]
    assert sorted(p.name for p in (out / "figures").iterdir()) == ["clip_score.png"]
    assert (out / "figures" / "clip_score.png").read_bytes() == real
    assert (out / "figures" / "clip_score.png").stat().st_mode & 0o7133 == 0  # rw for its owner, never executable
    text = everything_in(out)
    assert "fake-secret" not in text and "root:" not in text
    linked = ["env.png (a symbolic link)", "pw.png (a symbolic link)", "stats/stats.png (a symbolic link)"]
    assert report["not_read"] == linked
    assert any(all(n in note for n in linked) for note in info["notes"])  # and the page says which
    with serving(out) as port:
        for name in ("env.png", "pw.png", "stats.png"):
            status, body = get(port, f"/figures/{name}", f"127.0.0.1:{port}")
            assert status == 404 and b"fake-secret" not in body and b"root:" not in body
        assert get(port, "/figures/clip_score.png", f"127.0.0.1:{port}") == (200, real)


def test_linked_json_files_are_not_read(tmp_path):
    """meta.json, report.json and ontology.json that are links are left out (and named), never followed."""
    private = tmp_path / "private.json"
    private.write_text(json.dumps({"stage": "ontology", "secret": SECRET, "noun_to_class": {"dog": SECRET}}))
    ds = make_dataset(tmp_path / "ds", ["a dog"], per_shard=1)
    for name in ("meta.json", "report.json", "ontology.json"):
        (ds / name).unlink(missing_ok=True)
        (ds / name).symlink_to(private)
    report = build_view(ViewConfig(dataset=ds, out=tmp_path / "out"))
    assert "fake-secret" not in everything_in(tmp_path / "out")
    assert report["not_read"] == ["meta.json (a symbolic link)", "report.json (a symbolic link)"]


def test_a_linked_shard_is_one_error_before_anything_is_written(tmp_path):
    victim = make_dataset(tmp_path / "victim", ["private caption"], per_shard=1)
    ds = tmp_path / "ds"
    ds.mkdir()
    (ds / "sizes.json").write_text((victim / "sizes.json").read_text())
    for shard in json.loads((victim / "sizes.json").read_text()):
        (ds / shard).symlink_to(victim / shard)
    with pytest.raises(VlprepError, match=r"ds/shard-000000\.tar is a symbolic link: `vlprep view` follows no link"):
        build_view(ViewConfig(dataset=ds, out=tmp_path / "out"))
    assert not (tmp_path / "out").exists()


def test_a_view_folder_planted_in_the_dataset_writes_nowhere_else(tmp_path):
    """The default OUT, DATASET/view, came with the dataset: its links (index.html, the marker, thumbs/) are replaced,
    never written through, and a view/ that is itself a link is refused."""
    ds = make_dataset(tmp_path / "ds", ["a dog"], per_shard=1)
    victim = tmp_path / "bashrc"
    victim.write_text("mine")
    keep = tmp_path / "keep"
    keep.mkdir()
    (keep / "photo.jpg").write_text("mine")
    (ds / "view").mkdir()
    (ds / "view" / ".vlprep-view").symlink_to(victim)
    (ds / "view" / "index.html").symlink_to(victim)
    (ds / "view" / "thumbs").symlink_to(keep)
    build_view(ViewConfig(dataset=ds, samples=1))
    assert victim.read_text() == "mine" and (keep / "photo.jpg").read_text() == "mine"
    assert not any(p.is_symlink() for p in (ds / "view").iterdir())
    assert page_data(ds / "view")["info"]["shown"] == 1
    other = make_dataset(tmp_path / "other", ["a cat"], per_shard=1)
    (tmp_path / "elsewhere").mkdir()
    (other / "view").symlink_to(tmp_path / "elsewhere")
    with pytest.raises(VlprepError, match=r"--out .*/other/view is a symbolic link inside the dataset"):
        build_view(ViewConfig(dataset=other, samples=1))
    assert not any((tmp_path / "elsewhere").iterdir())


# --- 2. locations meta.json names are never opened --------------------------------------------------------------------


@contextlib.contextmanager
def recording_server(root: Path):
    """(base URL, the paths asked for) of an http.server on 127.0.0.1 serving `root`."""
    asked = []

    class Recording(http.server.SimpleHTTPRequestHandler):
        def log_message(self, *args) -> None:
            pass

        def send_head(self):
            asked.append(self.path)
            return super().send_head()

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(Recording, directory=str(root)))
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.1})
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", asked
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


def test_urls_that_meta_json_names_get_no_request(tmp_path):
    from tests.integration.servers import need

    need("fsspec", "aiohttp")
    served = tmp_path / "served" / "internal-only"
    served.mkdir(parents=True)
    make_dataset(served / "ds", [f"internal caption {i}" for i in range(4)], per_shard=2, prefix="in")
    with recording_server(tmp_path / "served") as (base, asked):
        named = f"{base}/internal-only/ds?token=s3cr3t-abc"
        filt = hand_dataset(tmp_path / "filt", [("k0", "kept", b"{}")], {"stage": "filter", "input": named})
        write_dropped(filt, [("in_000000000", "in-000000.tar"), ("in_000000003", "in-000001.tar")])
        pl = hand_dataset(tmp_path / "pl", [("u0", "a pseudo caption", json.dumps(
            {"pseudo": True, "neighbours": ["in_000000001", "in_000000002"]}).encode())],
            {"stage": "pseudolabel", "input": named, "aligned": named})
        reports = [build_view(ViewConfig(dataset=d, out=tmp_path / f"out-{d.name}")) for d in (filt, pl)]
        assert asked == []
    for d in (filt, pl):
        text = (tmp_path / f"out-{d.name}" / "index.html").read_text()
        assert "internal caption" not in text and "s3cr3t" not in text and "token=***" in text
    assert reports[0]["notes"] == [f"the dropped samples are shown without image or caption: pass --input DATASET, "
                                   f"the filter's input (meta.json names {base}/internal-only/ds?token=***)"]
    assert reports[1]["notes"] == [f"the neighbours' captions are not shown: pass --aligned DATASET, the "
                                   f"pseudolabel's aligned dataset (meta.json names {base}/internal-only/ds?token=***)"]


def test_local_folders_that_meta_json_names_are_read_only_when_given(tmp_path):
    victim = make_dataset(tmp_path / "victim", [f"private caption {i}" for i in range(4)], per_shard=2, prefix="v")
    meta = json.loads((victim / "meta.json").read_text())
    filt = hand_dataset(tmp_path / "filt", [("k0", "kept", b"{}")], {"stage": "filter", "input": str(victim)})
    write_dropped(filt, [("v_000000000", "v-000000.tar"), ("v_000000003", "v-000001.tar")])
    pl = hand_dataset(tmp_path / "pl", [("u0", "a pseudo caption", json.dumps(
        {"pseudo": True, "neighbours": ["v_000000001", "v_000000002"]}).encode())],
        {"stage": "pseudolabel", "input": str(victim), "aligned": str(victim)})

    build_view(ViewConfig(dataset=filt, out=tmp_path / "a"))
    build_view(ViewConfig(dataset=pl, out=tmp_path / "b"))
    for out in (tmp_path / "a", tmp_path / "b"):
        assert "private caption" not in (out / "index.html").read_text()
        lineage = page_data(out)["info"]["lineage"]
        assert lineage[1] == {"location": str(victim), "stage": "", "options": {}}  # named, its meta.json unread
    drops = [c for c in page_data(tmp_path / "a")["samples"] if "dropped" in c]
    assert [(c["key"], c["captions"], c["thumb"]) for c in drops] == [("v_000000000", [""], None),
                                                                      ("v_000000003", [""], None)]

    build_view(ViewConfig(dataset=filt, out=tmp_path / "a", input=victim))
    build_view(ViewConfig(dataset=pl, out=tmp_path / "b", aligned=victim))
    drops = [c for c in page_data(tmp_path / "a")["samples"] if "dropped" in c]
    assert [c["captions"] for c in drops] == [["private caption 0"], ["private caption 3"]]
    assert all((tmp_path / "a" / c["thumb"]["src"]).is_file() for c in drops)
    assert page_data(tmp_path / "a")["info"]["lineage"][1] == {"location": str(victim), "stage": "shards",
                                                               "options": meta["options"]}
    card = page_data(tmp_path / "b")["samples"][0]
    assert card["neighbour_captions"] == ["private caption 1", "private caption 2"]
    assert page_data(tmp_path / "b")["info"]["notes"] == []


def test_given_datasets_are_kept_apart_from_out(tmp_path):
    ds = make_dataset(tmp_path / "ds", ["a dog"], per_shard=1)
    build_view(ViewConfig(dataset=ds, out=tmp_path / "out"))
    inner = make_dataset(tmp_path / "out" / "inner", ["a cat"], per_shard=1)
    with pytest.raises(VlprepError, match=r"--out .*/out is \(or holds\) the --input dataset .*/out/inner; give "
                                          r"another folder"):
        build_view(ViewConfig(dataset=ds, out=tmp_path / "out", input=inner))
    with pytest.raises(VlprepError, match=r"--aligned is for a pseudolabel output; .* is a shards output"):
        build_view(ViewConfig(dataset=ds, out=tmp_path / "out2", aligned=inner))
    with pytest.raises(VlprepError, match=r"--input: dataset not found: .*/nope"):
        build_view(ViewConfig(dataset=ds, out=tmp_path / "out2", input=tmp_path / "nope"))
    linked = make_dataset(tmp_path / "linked", ["a cow"], per_shard=1)
    (linked / "shard-000000.parquet").rename(tmp_path / "side.parquet")
    (linked / "shard-000000.parquet").symlink_to(tmp_path / "side.parquet")
    with pytest.raises(VlprepError, match=r"linked/shard-000000\.parquet is a symbolic link"):
        build_view(ViewConfig(dataset=ds, out=tmp_path / "out2", input=linked))
    assert not (tmp_path / "out2").exists() and (inner / "sizes.json").is_file()


# --- 3. --serve: regular files under OUT, for its own Host only -------------------------------------------------------


def test_serve_answers_regular_files_under_out_for_its_own_host_only(tmp_path):
    ds = make_dataset(tmp_path / "ds", ["a dog"], per_shard=1)
    out = tmp_path / "out"
    build_view(ViewConfig(dataset=ds, out=out))
    private = tmp_path / "private"
    private.mkdir()
    (private / "secret.txt").write_text(SECRET)
    (out / "etclink").symlink_to("/etc")
    (out / "privlink").symlink_to(private)
    (out / "passwd").symlink_to("/etc/passwd")
    (out / "thumbs" / "s.jpg").symlink_to(private / "secret.txt")
    index = (out / "index.html").read_bytes()
    with serving(out) as port:
        own = f"127.0.0.1:{port}"
        assert get(port, "/index.html", own) == (200, index)
        assert get(port, "/", own) == (200, index)
        assert get(port, "/index.html?x=1", f"localhost:{port}") == (200, index)
        assert get(port, "/index.html", f"LOCALHOST:{port}") == (200, index)
        for path in ("/etclink/passwd", "/privlink/secret.txt", "/passwd", "/thumbs/s.jpg", "/thumbs/", "/thumbs",
                     "/etclink/", "/../private/secret.txt", "/%2e%2e/private/secret.txt", "/privlink%2fsecret.txt"):
            status, body = get(port, path, own)
            assert status == 404 and b"fake-secret" not in body and b"root:" not in body, path


def test_serve_refuses_a_host_header_other_than_its_own(tmp_path):
    """A page on evil.example that rebinds its name to 127.0.0.1 sends `Host: evil.example:PORT`: refused."""
    ds = make_dataset(tmp_path / "ds", ["a dog"], per_shard=1)
    build_view(ViewConfig(dataset=ds, out=tmp_path / "out"))
    index = (tmp_path / "out" / "index.html").read_bytes()
    with serving(tmp_path / "out") as port:
        assert get(port, "/index.html", f"127.0.0.1:{port}") == (200, index)
        for host in ("evil.example", f"evil.example:{port}", f"127.0.0.1:{port + 1}", "127.0.0.1", None):
            status, body = get(port, "/index.html", host)
            assert status == 421 and body != index, host


# --- 10. JSON nested 100,000 deep -------------------------------------------------------------------------------------


@pytest.mark.parametrize("where", ["json member", "meta.json", "report.json", "ontology.json"])
def test_json_nested_100000_deep_is_a_counted_skip(tmp_path, where):
    member = DEEP if where == "json member" else b'{"uid": "a"}'
    meta = DEEP if where == "meta.json" else {"stage": "ontology"}
    ds = hand_dataset(tmp_path / "ds", [("a", "a dog", member), ("b", "a cat", b'{"uid": "b"}')], meta)
    (ds / "report.json").write_bytes(DEEP if where == "report.json" else b'{"n": 2}')
    (ds / "ontology.json").write_bytes(DEEP if where == "ontology.json" else b'{"noun_to_class": {}}')
    report = build_view(ViewConfig(dataset=ds, out=tmp_path / "out"))
    cards = page_data(tmp_path / "out")["samples"]
    assert [c["captions"] for c in cards] == [["a dog"], ["a cat"]] and cards[1]["json"] == {"uid": "b"}
    if where == "json member":
        assert report["bad_json"] == 1 and report["not_read"] == [] and cards[0]["json"] == {}
    else:
        assert report["bad_json"] == 0 and cards[0]["json"] == {"uid": "a"}
        assert report["not_read"] == [f"{where} (not a JSON object nested at most 64 deep)"]


def test_the_terminal_says_what_was_left_out_in_a_line_each(tmp_path, vlprep):
    ds = hand_dataset(tmp_path / "ds", [("a", "a dog", DEEP), ("b", "a cat", b"{}")],
                      {"stage": "filter", "input": "s3://bucket/raw"})
    write_dropped(ds, [("r_1", "r-000000.tar")])
    (ds / "env.png").symlink_to("/proc/self/environ")
    r = vlprep("view", ds, "--out", tmp_path / "out")
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr
    lines = r.stderr.splitlines()
    assert ("warning: 1 of the drawn samples' json member is not a JSON object nested at most 64 deep; their cards "
            "show none of its fields") in lines
    assert "warning: files of the dataset left out: env.png (a symbolic link)" in lines
    assert ("note: the dropped samples are shown without image or caption: pass --input DATASET, the filter's input "
            "(meta.json names s3://bucket/raw)") in lines
    r = vlprep("view", ds, "--out", tmp_path / "out2", "--input", tmp_path / "missing")
    assert error_line(r) == f"error: --input: dataset not found: {tmp_path / 'missing'}"
