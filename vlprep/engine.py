"""The shard engine every vlprep stage runs on: plan -> `map_shards` -> summarise.

A stage plans its work as `Work` items, one per output shard (its name fixed by the plan, the inputs it needs as
paths and small values, a fingerprint of everything the shard depends on). `map_shards` skips the shards already
complete with the same fingerprint (resume), runs the stage's per-shard function for the rest on an executor,
advances the progress bar and returns every shard's counts for the report. The per-shard function writes its
shard itself, through `write_shard` (temporary names, then rename), so a stopped run leaves no half shard.

Executors (img2dataset's word, `--distributor`):
- `local`: the calling process when there is one worker, else a process pool of `--workers` processes;
- `ray`: `--workers` Ray actors of one CPU each (and a GPU share for `--device cuda`), on the cluster at
  RAY_ADDRESS when it is set, else on a Ray started here (docs/SCALE.md).
Each worker runs the stage's initializer once (models load once per worker, not per shard), and the function
reads what it set up from a module global of the stage. Only paths, fingerprints and counts travel between the
driver and the workers; image bytes are read where the shard is written. Outputs depend only on the plan, so
they are byte-identical for any distributor and worker count.

Workers never outlive the driver (vlprep.lifeline): SIGTERM or SIGINT (Ctrl-C) while shards run stops the workers
(terminated, then waited for) before `map_shards` raises `Stopped`, a KeyboardInterrupt, so OUT's lock is released
only when no worker is left; a driver killed outright takes its pool workers with it, and no worker renames a file
into OUT once its driver is gone.
"""

import os
import socket
import threading
from collections import Counter
from collections.abc import Callable, Iterable
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from multiprocessing import get_context
from typing import NamedTuple

from vlprep import VlprepError, cut, objstore
from vlprep.dataset import sidecar_name
from vlprep.lifeline import Driver, guard, reset_signals_in_worker, stop_on_signals, this_driver
from vlprep.output import Out, pull, shard_done

DISTRIBUTORS = ("local", "ray")
RAY_EXTRA = "pip install -e '.[ray]'"


class Work(NamedTuple):
    """One planned output shard: its name, the per-shard function's arguments, its fingerprint, its input samples.

    A derived stage's arguments start with (input folder, input shard name), the folder as `Dataset.source` gives it:
    for a remote input dataset (objstore.RemoteSrc) the worker fetches that shard and its sidecar into a local folder
    of its own first (`run_shard`)."""

    shard: str
    args: tuple
    fingerprint: str
    size: int


def default_workers(cap: int = 4) -> int:
    return min(cap, os.cpu_count() or 1)


def check_engine(distributor: str, workers: int) -> None:
    """One-line errors for a bad --distributor / --workers (before any output is touched)."""
    if distributor not in DISTRIBUTORS:
        raise VlprepError(f"unknown --distributor {cut(repr(distributor))}; use {' or '.join(DISTRIBUTORS)}")
    if workers < 1:
        raise VlprepError("--workers must be at least 1")
    if distributor == "ray":
        ray = _import_ray()
        address = os.environ.get("RAY_ADDRESS") or ""
        check_ray_address(address)  # a malformed address is the user's mistake even when Ray already runs here
        if not ray.is_initialized():
            _probe_ray_address(address)


def shard_fingerprint_done(out: Out, work: Work) -> dict | None:
    """The stored counts of `work.shard` in OUT when it is complete and was built from the same fingerprint."""
    done = shard_done(out, work.shard)
    return done if done is not None and done.get("fingerprint") == work.fingerprint else None


# --- executors: submit(fn, *args) -> Future; the initializer has run once in each worker ------------------------


class InlineExecutor:
    """The calling process: the initializer runs once here, each call runs at submit (one worker, no start-up)."""

    def __init__(self, init: Callable | None, initargs: tuple):
        if init is not None:
            init(*initargs)

    def submit(self, fn: Callable, *args) -> Future:
        fut = Future()
        fut.set_result(fn(*args))  # an exception propagates at once, with its own traceback
        return fut

    def shutdown(self, abort: bool = False) -> None:
        pass


def _start_pool_worker(driver: Driver, init: Callable | None, initargs: tuple) -> None:
    guard(driver, child=True)
    reset_signals_in_worker()
    if init is not None:
        init(*initargs)


class PoolExecutor(ProcessPoolExecutor):
    """A local process pool; `spawn` for stages whose models must not be forked (torch's thread pools).

    Its workers die with this process (vlprep.lifeline.guard), so the pool must be made, used and shut down from
    one thread that lives as long as it does (PR_SET_PDEATHSIG follows the thread that started a worker).
    """

    def __init__(self, workers: int, init: Callable | None, initargs: tuple, start: str = "fork"):
        super().__init__(workers, mp_context=get_context(start), initializer=_start_pool_worker,
                         initargs=(this_driver(), init, initargs))

    def shutdown(self, wait: bool = True, abort: bool = False, **kw) -> None:
        """`abort`: stop the running shards now rather than let them finish (they leave only *.tmp files, which the
        next run clears), and return once every worker has exited."""
        # Python 3.14 has terminate_workers(); before it the pool keeps its processes in _processes.
        procs = list((self._processes or {}).values()) if abort else []
        for p in procs:
            p.terminate()
        super().shutdown(wait=wait or abort, cancel_futures=True)
        for p in procs:
            p.join()


def _import_ray():
    try:
        import ray
    except ImportError:
        raise VlprepError(f"--distributor ray needs Ray, which is an extra: {RAY_EXTRA}") from None
    return ray


RAY_CONNECT_TIMEOUT = "VLPREP_RAY_CONNECT_TIMEOUT"  # seconds to reach RAY_ADDRESS (default 10)


RAY_FORMS = "HOST:PORT (e.g. 127.0.0.1:6379), ray://HOST:PORT, auto or local"


def _host_port(text: str) -> bool:
    """Whether `text` is HOST:PORT as ray parses it: a host without ':' (an IPv6 one in brackets), a port 1-65535."""
    if text.startswith("["):
        host, sep, port = text[1:].partition("]:")
    else:
        host, sep, port = text.rpartition(":")
        sep = sep if ":" not in host else ""
    return (bool(sep) and bool(host) and not any(c.isspace() for c in host) and port.isascii() and port.isdigit()
            and 1 <= int(port) <= 65535)


def check_ray_address(address: str) -> None:
    """A one-line VlprepError naming RAY_ADDRESS when it is none of the forms ray.init takes (ray's
    canonicalize_bootstrap_address: HOST:PORT, "auto", "local"; ray.init: SCHEME://..., the Ray Client, ray://HOST:PORT
    for Ray's own). ray.init's own error is `ValueError: Invalid address format` deep in a traceback. Another
    SCHEME:// is a Ray Client module ray.init imports: left to it (ray_connect makes its error one line too)."""
    if address in ("", "auto", "local"):
        return
    scheme, sep, rest = address.partition("://")
    if sep and scheme in ("http", "https"):
        why = "an http(s) address is a dashboard or API server, not a Ray cluster"
    elif sep and scheme != "ray":
        return
    elif _host_port(rest if sep else address):
        return
    else:
        why = "not a Ray address"
    raise VlprepError(f"RAY_ADDRESS={cut(address)}: {why}; give {RAY_FORMS}, or unset it to start a Ray here")


def _probe_ray_address(address: str) -> None:
    """A one-line error when RAY_ADDRESS names a host:port nothing answers on within the timeout (or is no address:
    check_ray_address).

    ray.init retries an unreachable address for minutes (ray 2.60: over 180 s for 127.0.0.1:1), inside a C++
    call that no timeout of ours can cut short, so the address is tried with a plain TCP connection first. An
    address that accepts connections but is no Ray cluster is still ray.init's to judge."""
    check_ray_address(address)
    if address in ("", "local"):
        return  # a Ray started here
    target = address.split("://", 1)[1] if "://" in address else address
    if address == "auto":  # the address file of the Ray last started on this machine (ray.init's own lookup)
        try:
            from ray._private.services import canonicalize_bootstrap_address

            target = canonicalize_bootstrap_address(address) or ""
        except Exception:
            return  # no such file, or another Ray version: ray.init says what is wrong
    host, _, port = target.rpartition(":")
    if not host or not port.isdigit():
        return  # not host:port: ray.init says what is wrong
    try:
        timeout = float(os.environ.get(RAY_CONNECT_TIMEOUT) or 10)
    except ValueError:
        raise VlprepError(f"{RAY_CONNECT_TIMEOUT} must be a number of seconds") from None
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=timeout).close()
    except OSError as e:
        why = "timed out" if isinstance(e, TimeoutError) else (e.strerror or str(e)).lower()
        raise VlprepError(f"cannot reach the Ray cluster at RAY_ADDRESS={address} ({why}, within {timeout:g} s); "
                          "start it, fix RAY_ADDRESS, or unset it to start a Ray here") from None


def _token_refused(e: BaseException) -> bool:
    """Whether ray.init failed because the cluster wants an authentication token (what `ray start` turns on by
    default in recent Ray, 2.60 here): ray.init raises "ConnectionError: Failed to connect ..." from Ray's
    AuthenticationError, whose text is the cause ("Authentication token is missing or incorrect")."""
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if type(e).__name__ == "AuthenticationError" or "Authentication token is missing" in str(e):
            return True
        e = e.__cause__ or e.__context__
    return False


def ray_connect():
    """The ray module, connected: to RAY_ADDRESS when set, else to a Ray started here; ray.init runs at most once."""
    ray = _import_ray()
    if not ray.is_initialized():
        address = os.environ.get("RAY_ADDRESS") or ""
        _probe_ray_address(address)
        # ray.init reads RAY_ADDRESS itself; without it, it starts a local Ray with every CPU of this machine.
        try:
            ray.init(address=address or None, include_dashboard=False, log_to_driver=False, logging_level="WARNING")
        except Exception as e:  # ConnectionError, RuntimeError, ValueError, a Ray Client module that is not there...
            lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
            why = f"{type(e).__name__}: {cut(lines[0], 200)}" if lines else type(e).__name__
            if address and _token_refused(e):
                raise VlprepError(f"cannot connect to the Ray cluster at RAY_ADDRESS={cut(address)}: it uses token "
                                  "authentication and this driver's token is missing or wrong; copy the cluster's "
                                  "token into ~/.ray/auth_token (or set RAY_AUTH_TOKEN) and set RAY_AUTH_MODE=token"
                                  ) from None
            if address:
                raise VlprepError(f"cannot connect to the Ray cluster at RAY_ADDRESS={cut(address)} ({why}); start "
                                  "it, fix RAY_ADDRESS, or unset it to start a Ray here") from None
            raise VlprepError(f"cannot start a local Ray (RAY_ADDRESS is unset) ({why}); set RAY_ADDRESS to a "
                              "running cluster, or use --distributor local") from None
    return ray


class _RayWorker:
    """The body of one Ray actor: the stage's initializer at start, then per-shard calls."""

    def __init__(self, driver: Driver, init: Callable | None, initargs: tuple):
        guard(driver, child=False)
        if init is not None:
            init(*initargs)

    def run(self, fn: Callable, args: tuple):
        return fn(*args)


class RayExecutor:
    """N Ray actors of one CPU each (plus a GPU share when asked); each call goes to the least busy actor."""

    def __init__(self, workers: int, init: Callable | None, initargs: tuple, gpu: bool = False):
        ray = ray_connect()
        self.ray = ray
        opts = {"num_cpus": 1}
        if gpu:
            gpus = ray.cluster_resources().get("GPU", 0)
            if not gpus:
                raise VlprepError("--device cuda with --distributor ray: the Ray cluster has no GPU")
            opts["num_gpus"] = min(1.0, gpus / workers)
        actor = ray.remote(**opts)(_RayWorker)
        # initargs go to the object store once, not once per actor
        args_ref = ray.put(initargs)
        driver = this_driver()
        self.actors = [actor.remote(driver, init, args_ref) for _ in range(workers)]
        self.busy = [0] * workers
        self.running: set = set()  # refs of the calls not finished yet
        self.lock = threading.Lock()

    def ready(self) -> None:
        """Wait until every actor has run its initializer (benchmarks time the work without the start-up)."""
        self.ray.get([a.run.remote(len, ((),)) for a in self.actors])

    def submit(self, fn: Callable, *args) -> Future:
        with self.lock:
            i = min(range(len(self.actors)), key=self.busy.__getitem__)
            self.busy[i] += 1
        ref = self.actors[i].run.remote(fn, args)
        out = Future()
        with self.lock:
            self.running.add(ref)

        def done(f: Future) -> None:
            with self.lock:
                self.busy[i] -= 1
                self.running.discard(ref)
            exc = f.exception()
            if exc is None:
                out.set_result(f.result())
            else:  # the worker's own exception (a VlprepError stays one line), not Ray's wrapper with its traceback
                out.set_exception(getattr(exc, "cause", None) or exc)

        ref.future().add_done_callback(done)
        return out

    def shutdown(self, abort: bool = False) -> None:
        for a in self.actors:
            self.ray.kill(a)
        if abort:  # ray.kill only asks: wait (a little) until the running calls have failed with their actors
            with self.lock:
                running = list(self.running)
            if running:
                self.ray.wait(running, num_returns=len(running), timeout=10)


def make_executor(distributor: str, workers: int, init: Callable | None = None, initargs: tuple = (),
                  start: str = "fork", gpu: bool = False):
    """An executor of `workers` workers that each ran init(*initargs) once."""
    check_engine(distributor, workers)
    if distributor == "ray":
        return RayExecutor(workers, init, initargs, gpu)
    if workers == 1:
        return InlineExecutor(init, initargs)
    return PoolExecutor(workers, init, initargs, start)


# --- the engine ------------------------------------------------------------------------------------------------


def run_shard(fn: Callable[..., dict], out: Out, args: tuple, fp: str) -> dict:
    """fn(out, *args, fp) in a worker. Object storage: a URL OUT's staging folder is made here (write_shard uploads
    from it), and a remote input shard (objstore.RemoteSrc) is read from a local copy, removed afterwards."""
    if out.url is not None:
        out.root.mkdir(parents=True, exist_ok=True)
    if args and isinstance(args[0], objstore.RemoteSrc):
        with objstore.fetched(args[0], (sidecar_name(args[1]), args[1])) as local:
            return fn(out, local, *args[1:], fp)
    return fn(out, *args, fp)


def map_shards(out: Out, plan: Iterable[Work], fn: Callable[..., dict], *, init: Callable | None = None,
               initargs: tuple = (), workers: int = 1, distributor: str = "local", progress=None,
               label: str = "", total: int | None = None, start: str = "fork", gpu: bool = False,
               done: Callable[[Out, Work], dict | None] = shard_fingerprint_done,
               executor=None, fold: Callable[[str, dict], dict] | None = None) -> tuple[dict[str, dict], set[str]]:
    """fn(out, *work.args, work.fingerprint) -> counts, for each planned shard not done; ({shard: counts}, resumed).

    `resumed` holds the shards found complete; `counts` is in plan order, a resumed shard's as stored.

    The plan may be a generator (`vlprep shards` streams its source): at most two shards per worker are in flight,
    so memory stays bounded by the shard size. The executor, and with it the models, starts only when a shard is
    left to do. `executor` lets a caller reuse one it made (benchmarks exclude the start-up that way).
    `fold(shard, counts)` is called in the driver, in plan order, as soon as a shard and every shard before it
    are done (resumed ones too); what it returns is kept instead of the counts, so a stage can merge a bulky part
    of them (a shard's word counts) into its totals at once rather than hold every shard's until the end. Plan
    order makes the totals the same whatever order the workers finish in.
    SIGTERM or SIGINT raise `Stopped` (a KeyboardInterrupt) once the executor made here is stopped and its workers
    have exited; a caller's own executor is the caller's to stop.
    """
    stats: dict[str, dict | None] = {}
    pending: dict[Future, Work] = {}
    resumed: set[str] = set()
    task = progress.add_task(label, total=total) if progress is not None else None
    ex = executor
    own = executor is None
    portable = out.portable()  # what travels to the workers: the folder and the URL, not the lock
    order: list[str] = []  # the plan's shards; order[folded:] are not folded yet
    folded = 0

    def fold_ready() -> None:
        nonlocal folded
        while fold is not None and folded < len(order) and stats[order[folded]] is not None:
            stats[order[folded]] = fold(order[folded], stats[order[folded]])
            folded += 1

    def collect(futures) -> None:
        for fut in futures:
            work = pending.pop(fut)
            stats[work.shard] = fut.result()
            if out.url is not None and done is shard_fingerprint_done:
                pull(out, sidecar_name(work.shard))  # a worker on another machine kept it there
            if progress is not None:
                progress.advance(task, work.size)
        fold_ready()

    stopped = False
    with stop_on_signals():  # SIGTERM / SIGINT -> Stopped: the workers are stopped before it propagates
        try:
            for work in plan:
                if work.shard in stats:
                    raise VlprepError(f"internal: shard {work.shard} planned twice")
                order.append(work.shard)
                previous = done(out, work)
                if previous is not None:
                    stats[work.shard] = previous
                    resumed.add(work.shard)
                    if progress is not None:
                        progress.advance(task, work.size)
                    fold_ready()
                    continue
                stats[work.shard] = None  # keeps the plan's order in the result
                if ex is None:
                    ex = make_executor(distributor, workers, init, initargs, start, gpu)
                pending[ex.submit(run_shard, fn, portable, work.args, work.fingerprint)] = work
                if len(pending) >= 2 * workers:
                    collect(wait(pending, return_when=FIRST_COMPLETED).done)
            while pending:
                collect(wait(pending, return_when=FIRST_COMPLETED).done)
        except KeyboardInterrupt:
            stopped = True
            raise
        finally:
            if own and ex is not None:
                ex.shutdown(abort=stopped)
    return stats, resumed


def merged_skips(stats: Iterable[dict], examples_key: str = "skipped_examples", limit: int = 5) -> tuple[Counter, dict]:
    """Per-shard stats -> the skip counts by reason summed over the shards, and up to `limit` example keys per
    reason, in shard order."""
    skipped = Counter()
    examples = {}
    for st in stats:
        skipped.update(st["skipped"])
        for why, keys in st.get(examples_key, {}).items():
            examples[why] = (examples.get(why, []) + list(keys))[:limit]
    return skipped, examples
