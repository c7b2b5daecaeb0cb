"""Credentials in a dataset URL never reach a file, a log line or an error (vlprep.urls): every vlprep stage
(filter's --exclude eval sets too, and `vlprep view`'s pages), a `vltrain run` (and its resume), `vltrain eval` and
`vltrain export` read datasets from an HTTP server on 127.0.0.1 that wants a secret (basic auth's password in the
URL, or a ?token= query), then every byte they wrote (inside checkpoints too: the zip's members, and the config
torch.load gives back) and every byte they printed is searched for the secret."""

import base64
import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import torch

from tests.conftest import colour_pairs, tiny_checkpoint
from tests.integration.servers import http_server, need

pytestmark = pytest.mark.slow
ROOT = Path(__file__).parents[2]
SECRET = "Zq7S3cr3tPw9"
TINY = ["model.text_model=tiny", "model.image_model=tiny", "model.embed_dim=16", "data.image_size=32",
        "data.workers=0", "data.max_len=12", "log_every=1", "optim.warmup_steps=2", "eval_every=1"]
ENV = {**os.environ, "PYTHONPATH": str(ROOT), "VLPREP_REMOTE_TRIES": "2", "VLPREP_REMOTE_BACKOFF": "0.01",
       "COLUMNS": "200"}


def forms() -> list[bytes]:
    """The secret as it could leak: plain, and inside a basic-auth header."""
    return [SECRET.encode(), base64.b64encode(f"alice:{SECRET}".encode())]


def leaks(data: bytes) -> bool:
    return any(f in data for f in forms())


def run(module: str, *args, ok: bool = True) -> subprocess.CompletedProcess:
    r = subprocess.run([sys.executable, "-m", module, *map(str, args)], capture_output=True, timeout=600, env=ENV)
    assert (r.returncode == 0) == ok, (args, r.stderr.decode()[-3000:])
    return r


def files_leaking(root: Path) -> list[str]:
    """Every file under `root` whose bytes hold the secret; a zip's (a checkpoint's) members are read too, and a
    checkpoint's config as torch.load gives it back."""
    found = []
    for p in sorted(root.rglob("*")):
        if not p.is_file():
            continue
        data = p.read_bytes()
        if leaks(data):
            found.append(str(p))
        if zipfile.is_zipfile(p):
            with zipfile.ZipFile(p) as z:
                found += [f"{p}:{m}" for m in z.namelist() if leaks(z.read(m))]
        if p.suffix == ".pt":
            ckpt = torch.load(p, map_location="cpu", weights_only=True)
            if leaks(repr(ckpt.get("config")).encode()):
                found.append(f"{p}: config")
        if p.suffix == ".parquet" and leaks(repr(pq.read_table(p).to_pylist()).encode()):
            found.append(f"{p}: rows")
    return found


def test_no_byte_written_or_printed_holds_the_secret(tmp_path):
    need("fsspec", "aiohttp")
    src = colour_pairs(tmp_path, 12, per_shard=4)
    keys = [k for f in sorted(src.glob("*.parquet")) for k in pq.read_table(f)["key"].to_pylist()]
    (tmp_path / "dets.jsonl").write_text("".join(
        json.dumps({"key": k, "objects": [{"label": ["cat", "dog"][i % 2], "score": 0.9, "box": [0, 0, 1, 1]}]}) + "\n"
        for i, k in enumerate(keys)))
    ckpt = tiny_checkpoint(tmp_path / "tiny.pt")
    out = tmp_path / "out"
    out.mkdir()
    printed = []
    with http_server(tmp_path, secret=SECRET) as (base, _):
        host = base.removeprefix("http://")
        basic = lambda folder: f"http://alice:{SECRET}@{host}/{folder}/"  # noqa: E731
        token = lambda folder: f"{base}/{folder}/?token={SECRET}"  # noqa: E731
        steps = [
            ("vlprep.cli", "bow", basic("ds"), out / "bow", "--ops", "shuffle,keep:3", "--base-frac", "0.5"),
            ("vlprep.cli", "detect", token("ds"), out / "det", "--from-file", tmp_path / "dets.jsonl"),
            ("vlprep.cli", "ontology", basic("out/det"), out / "onto", "--min-cooccur", "1", "--min-instances", "1"),
            ("vlprep.cli", "features", token("ds"), out / "feat", "--size", "64", "--device", "cpu"),
            ("vlprep.cli", "embed", basic("ds"), out / "emb", "--checkpoint", ckpt, "--device", "cpu"),
            ("vlprep.cli", "pseudolabel", basic("ds"), token("out/bow"), out / "pl", "--checkpoint", ckpt, "--device",
             "cpu"),
            ("vlprep.cli", "stats", token("ds"), "--out", out / "stats"),
            ("vlprep.cli", "filter", basic("ds"), out / "filt", "--dedup", "image", "--exclude", token("ds"),
             "--near-dup", "0.99", "--phash", "4", "--checkpoint", ckpt, "--device", "cpu"),
            ("vlprep.cli", "view", token("out/pl"), "--out", out / "view-pl", "--samples", "6"),
            ("vlprep.cli", "view", basic("out/onto"), "--out", out / "view-onto", "--samples", "6"),
            ("vltrain", "run", basic("ds"), "--out", out / "run", "--steps", "2", "--batch-size", "4", "--device",
             "cpu", "--preset", "clip", *[x for s in TINY for x in ("--set", s)]),
            ("vltrain", "run", basic("ds"), "--out", out / "run", "--steps", "3", "--batch-size", "4", "--device",
             "cpu", "--preset", "clip", "--resume", *[x for s in TINY for x in ("--set", s)]),
            ("vltrain", "eval", out / "run" / "last.pt", token("ds"), "--out", out / "eval.json", "--device", "cpu"),
            ("vltrain", "export", out / "run" / "last.pt", out / "export"),
        ]
        for module, *args in steps:
            printed.append(run(module, *args))
        # errors: a missing dataset, a wrong token (401), and an s3:// URL with credentials
        errors = [(f"(no sizes.json): http://{host}/nope", "vlprep.cli", "bow", basic("nope"), out / "e1"),
                  ("401", "vlprep.cli", "bow", f"{base}/ds/?token=x{SECRET}", out / "e2"),
                  (f"http://{host}/nope", "vltrain", "run", basic("nope"), "--out", out / "e3", "--device", "cpu",
                   "--preset", "clip", *[x for s in TINY for x in ("--set", s)]),
                  ("AWS_ACCESS_KEY_ID", "vlprep.cli", "bow", f"s3://AKIA:{SECRET}@bkt/ds/", out / "e4")]
        for says, module, *args in errors:
            r = run(module, *args, ok=False)
            lines = r.stderr.decode().strip().splitlines()
            assert r.returncode == 2 and lines[-1].startswith("error: ") and says in lines[-1], lines
            printed.append(r)
    assert json.loads((out / "run" / "result.json").read_text())["step"] == 3
    assert json.loads((out / "bow" / "meta.json").read_text())["input"] == f"http://{host}/ds"
    assert json.loads((out / "det" / "meta.json").read_text())["input"] == f"{base}/ds?token=***"
    assert (out / "export" / "config.json").exists() and (out / "feat" / "sizes.json").exists()
    assert f"{base}/out/pl?token=***" in (out / "view-pl" / "index.html").read_text()  # the page names it, redacted
    assert json.loads((out / "filt" / "meta.json").read_text())["options"]["exclude"] == [f"{base}/ds?token=***"]
    for r in printed:
        assert not leaks(r.stdout + r.stderr), (r.args, (r.stdout + r.stderr).decode()[-3000:])
    assert files_leaking(out) == []
