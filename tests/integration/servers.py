"""Real servers on 127.0.0.1 for the object-storage tests (never another address): a static HTTP server with byte
ranges and injectable faults (Python's http.server in a thread), and moto's standalone S3 server (a subprocess).

Both stop by themselves when their context ends; every wait on them is bounded."""

import contextlib
import functools
import http.server
import os
import re
import shutil
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

CLOUD_EXTRA = "pip install -e '.[cloud,test]'"


def need(*modules: str) -> None:
    """Skip, naming the extra, when a module of the [cloud] extra (or moto, of [test]) is missing; in CI (`CI` set,
    where the Makefile installs both) fail instead, as the Ray tests do."""
    for name in modules:
        try:
            __import__(name)
        except ImportError:
            if os.environ.get("CI"):
                raise
            pytest.skip(f"{name} is not installed: the object-storage tests need the [cloud] extra ({CLOUD_EXTRA})")


class Faults:
    """What the HTTP server does wrong: `drop[name] = n` cuts the next n answers for files named `name` in the middle
    of their body (then closes the connection); `fail` is a set of names always answered 503."""

    def __init__(self):
        self.drop: dict[str, int] = {}
        self.fail: set[str] = set()
        self.dropped = 0  # answers cut so far
        self.lock = threading.Lock()

    def take_drop(self, name: str) -> bool:
        with self.lock:
            if self.drop.get(name, 0) > 0:
                self.drop[name] -= 1
                self.dropped += 1
                return True
        return False


class RangeHandler(http.server.SimpleHTTPRequestHandler):
    """SimpleHTTPRequestHandler with `Range: bytes=a-b` (206 answers), as object stores and nginx serve files:
    fsspec's HTTP files read in ranged blocks. Its `faults` cut or fail answers on purpose."""

    faults: Faults = Faults()
    secret: str = ""  # when set, every request needs it: basic auth with it as the password, or ?token=SECRET
    _RANGE = re.compile(r"bytes=(\d+)-(\d*)$")

    def log_message(self, *args) -> None:  # quiet: pytest shows stderr of failing tests
        pass

    def authorised(self) -> bool:
        import base64
        from urllib.parse import parse_qs, urlsplit

        given = self.headers.get("Authorization", "")
        if given.startswith("Basic "):
            _, _, password = base64.b64decode(given[6:]).decode().partition(":")
            return password == self.secret
        return parse_qs(urlsplit(self.path).query).get("token") == [self.secret]

    def send_head(self):
        if self.secret and not self.authorised():
            self.send_error(401, "Unauthorized")
            return None
        name = os.path.basename(self.path.split("?", 1)[0])
        if name in self.faults.fail:
            self.send_error(503, "Service Unavailable (on purpose)")
            return None
        path = self.translate_path(self.path)
        if os.path.isdir(path) or not os.path.isfile(path):
            return super().send_head()
        size = os.path.getsize(path)
        match = self._RANGE.match(self.headers.get("Range", ""))
        start, end = 0, size - 1
        if match:
            start = int(match.group(1))
            end = min(int(match.group(2)), size - 1) if match.group(2) else size - 1
            if start >= size:
                self.send_error(416, "Requested Range Not Satisfiable")
                return None
        f = open(path, "rb")
        f.seek(start)
        self.send_response(206 if match else 200)
        self.send_header("Content-Type", "application/octet-stream")
        self.send_header("Accept-Ranges", "bytes")
        self.send_header("Content-Length", str(end - start + 1))
        if match:
            self.send_header("Content-Range", f"bytes {start}-{end}/{size}")
        self.send_header("ETag", f'"{os.stat(path).st_mtime_ns:x}-{size:x}"')
        self.end_headers()
        self._left = end - start + 1
        self._cut = self.command == "GET" and self.faults.take_drop(name)
        return f

    def copyfile(self, source, outputfile) -> None:
        left = self._left // 2 if self._cut else self._left
        while left > 0:
            chunk = source.read(min(left, 1 << 16))
            if not chunk:
                break
            outputfile.write(chunk)
            left -= len(chunk)
        if self._cut:  # the connection drops in the middle of the body
            outputfile.flush()
            self.close_connection = True
            with contextlib.suppress(OSError):
                self.connection.shutdown(socket.SHUT_RDWR)


@contextlib.contextmanager
def http_server(root: Path, secret: str = ""):
    """(base URL, Faults) of a threaded HTTP server on 127.0.0.1 serving `root`; shut down at the end. With `secret`,
    a request needs it (basic auth's password, or a ?token= query value), else 401."""
    faults = Faults()
    handler = type("Handler", (RangeHandler,), {"faults": faults, "secret": secret})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(handler, directory=str(root)))
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.1}, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", faults
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)


@contextlib.contextmanager
def http_server_process(root: Path):
    """The base URL of the same server (without faults) in a process of its own, as a real server is: the
    benchmarks' clients then share no interpreter lock with it. Killed at the end."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, __file__, str(root), str(port)], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[2])})
    try:
        _wait_for(port, proc, "the HTTP server")
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.kill()
        proc.wait(timeout=10)


def _wait_for(port: int, proc: subprocess.Popen, what: str, log: Path | None = None) -> None:
    deadline = time.monotonic() + 30
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"{what} did not start" + (f": {log.read_text()[-2000:]}" if log else "")) from None
            time.sleep(0.1)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


S3_ENV = {"AWS_ACCESS_KEY_ID": "test", "AWS_SECRET_ACCESS_KEY": "test", "AWS_DEFAULT_REGION": "us-east-1"}


@contextlib.contextmanager
def moto_s3(log: Path):
    """The S3 endpoint URL of moto's standalone server (`python -m moto.server`) on 127.0.0.1, killed at the end."""
    port = free_port()
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                                stdout=out, stderr=subprocess.STDOUT, env={**os.environ, **S3_ENV})
    try:
        _wait_for(port, proc, "moto_server", log)
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.kill()
        proc.wait(timeout=10)


def s3_env(endpoint: str) -> dict:
    """The standard variables botocore reads (no option of ours): the local endpoint and dummy credentials."""
    return {**S3_ENV, "AWS_ENDPOINT_URL": endpoint}


def copy_tree(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


if __name__ == "__main__":  # http_server_process: python servers.py ROOT PORT
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", int(sys.argv[2])),
                                            functools.partial(RangeHandler, directory=sys.argv[1]))
    httpd.daemon_threads = True
    httpd.serve_forever()
