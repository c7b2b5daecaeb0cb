"""train.report_to: the config key, the rows and parameters the trackers get, and real offline W&B and MLflow runs
read back and compared with metrics.jsonl (a resume continuing the same tracked run)."""

import io
import json
import struct
import sys
from dataclasses import fields, is_dataclass
from pathlib import Path

import pytest
from rich.console import Console
from typer.testing import CliRunner

from tests.vltrain.test_train import run as train_run, shards  # noqa: F401  (the tiny shards fixture)
from vltrain import tracking
from vltrain.cli import app
from vltrain.config import ConfigError
from vltrain.config_load import load_config
from vltrain.errors import TrainError


def run(shards, out, *args):  # noqa: F811
    """test_train's tiny clip run, evaluated every 2 steps (a tracker gets the held-out rows too)."""
    return train_run(shards, out, "--preset", "clip", "--set", "eval_every=2", *args)


def rows(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def flat(row: dict, prefix: str = "") -> dict:
    """A row's numbers as the trackers should get them, written out independently of tracking.metrics."""
    found = {}
    for key, value in row.items():
        if prefix + key == "step":
            continue
        if isinstance(value, dict):
            found.update(flat(value, f"{prefix}{key}/"))
        elif type(value) in (int, float, bool):
            found[prefix + key] = float(value)
    return found


def expected_history(out: Path) -> dict[str, dict[int, float]]:
    """{metric: {step: value}} from metrics.jsonl."""
    found = {}
    for row in rows(out):
        for key, value in flat(row).items():
            found.setdefault(key, {})[row["step"]] = value
    return found


# --- the config key ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("value, expected", [
    (None, ["tensorboard"]), ("wandb,mlflow", ["wandb", "mlflow"]), ("[wandb, mlflow]", ["wandb", "mlflow"]),
    ("mlflow", ["mlflow"]), ("none", []), ("[]", []), ("", []), ("wandb,wandb", ["wandb"]),
    ("tensorboard, wandb", ["tensorboard", "wandb"])])
def test_report_to_values(value, expected):
    sets = [] if value is None else [f"train.report_to={value}"]
    assert load_config("clip", sets=sets).train.report_to == expected


def test_report_to_unknown_tracker_is_one_line():
    with pytest.raises(ConfigError, match=r"^train.report_to: unknown tracker 'comet'; use tensorboard, wandb, "
                                          r"mlflow or none$"):
        load_config("clip", sets=["train.report_to=wandb,comet"])


def test_config_command_shows_report_to():
    result = CliRunner().invoke(app, ["config", "--set", "train.report_to=wandb,mlflow"])
    assert result.exit_code == 0
    assert "report_to: [wandb, mlflow]" in result.output


# --- what the trackers get ----------------------------------------------------------------------------------------


def test_metrics_are_the_rows_numbers_under_their_keys():
    row = {"step": 7, "total": 1.25, "bad_samples": 3, "val": {"mean_recall": 50.0, "task": "val samples",
                                                               "chance": {"i2t_r1": 12.5}, "step": 7},
           "curriculum": {"probs": [0.5, 0.5], "refreshed": True}}
    assert tracking.metrics(row) == {"total": 1.25, "bad_samples": 3.0, "val/mean_recall": 50.0,
                                     "val/chance/i2t_r1": 12.5, "val/step": 7.0, "curriculum/refreshed": 1.0}
    assert tracking.metrics(row) == flat(row)


def test_params_are_the_config_dotted_with_urls_redacted():
    cfg = load_config("clip", sets=["batch_size=8"], shards=["https://alice:s3cret@host/ds/{0..3}.tar?sig=x"])
    params = tracking.params(cfg)
    assert params["batch_size"] == 8
    assert params["optim.lr"] == cfg.optim.lr
    assert params["train.report_to"] == ["tensorboard"]
    assert params["shards"] == ["https://host/ds/{0..3}.tar?sig=***"]
    assert "s3cret" not in json.dumps(params)
    keys = set()
    for f in fields(cfg):  # every key of every section, as `vltrain config` lists them
        value = getattr(cfg, f.name)
        keys |= {f"{f.name}.{g.name}" for g in fields(value)} if is_dataclass(value) else {f.name}
    assert set(params) == keys


class Fake:
    """A tracker that records what it is given."""

    module = "json"  # installed everywhere: check_installed finds it
    calls: list = []

    def start(self, config, name, resume_id):
        self.calls.append(("start", resume_id))
        return resume_id or "run-1"

    def log(self, values, step):
        self.calls.append((step, sorted(values)))

    def artifact(self, path):
        self.calls.append(("artifact", path.name, json.loads(path.read_text()) if path.suffix == ".json" else None))

    def finish(self, ok):
        self.calls.append(("finish", ok))


def fake_trackers(monkeypatch, tmp_path, cls=Fake):
    cls.calls = []
    monkeypatch.setitem(tracking.TRACKERS, "wandb", cls)
    cfg = load_config("clip", sets=["train.report_to=wandb"], out=str(tmp_path))
    return tracking.Trackers(cfg, tmp_path, 0, None)


def test_a_resumed_tracker_skips_the_rows_it_had(monkeypatch, tmp_path):
    (tmp_path / "tracking.json").write_text(json.dumps({"wandb": {"id": "abc", "step": 3, "kinds": ["train"]}}))
    t = fake_trackers(monkeypatch, tmp_path)
    for row in ({"step": 2, "total": 1.0}, {"step": 3, "total": 1.0}, {"step": 3, "val": {"mean_recall": 1.0}},
                {"step": 4, "total": 1.0}, {"step": 4, "curriculum": {"heldout_r1": 0.5}}):
        t.log(row)
    t.finish({"mean_recall": 1.0}, True)
    assert Fake.calls == [("start", "abc"), (3, ["val/mean_recall"]), (4, ["total"]), (4, ["curriculum/heldout_r1"]),
                          ("artifact", "eval.json", {"mean_recall": 1.0}), ("finish", True)]
    assert json.loads((tmp_path / "tracking.json").read_text()) == {
        "wandb": {"id": "abc", "step": 4, "kinds": ["train", "curriculum"]}}


def test_an_unreadable_tracking_json_is_one_line(monkeypatch, tmp_path):
    (tmp_path / "tracking.json").write_text("{not json")
    with pytest.raises(TrainError, match=r"^.*tracking.json: not the tracked runs' ids \(JSON\); delete it to start "
                                         r"new tracked runs$"):
        fake_trackers(monkeypatch, tmp_path)


def test_other_ranks_track_nothing(monkeypatch, tmp_path):
    monkeypatch.setitem(tracking.TRACKERS, "wandb", Fake)
    Fake.calls = []
    t = tracking.Trackers(load_config("clip", sets=["train.report_to=wandb"]), tmp_path, 1, None)
    t.log({"step": 1, "total": 1.0})
    t.finish(None, True)
    assert Fake.calls == []
    assert not (tmp_path / "tracking.json").exists()


def test_a_tracker_that_cannot_start_is_one_line(monkeypatch, tmp_path):
    class NoLogin(Fake):
        def start(self, config, name, resume_id):
            raise RuntimeError("api_key not configured (no-tty)\ncall wandb.login()")

    with pytest.raises(TrainError, match=r"^train.report_to=wandb: could not start its run: api_key not configured "
                                         r"\(no-tty\)$"):
        fake_trackers(monkeypatch, tmp_path, NoLogin)


def test_a_tracker_that_cannot_start_ends_those_started_before_it(monkeypatch, tmp_path):
    class NoServer(Fake):
        def start(self, config, name, resume_id):
            raise ConnectionError("http://mlflow:5000 refused the connection")

    Fake.calls = []
    monkeypatch.setitem(tracking.TRACKERS, "wandb", Fake)
    monkeypatch.setitem(tracking.TRACKERS, "mlflow", NoServer)
    cfg = load_config("clip", sets=["train.report_to=wandb,mlflow"])
    with pytest.raises(TrainError, match=r"^train.report_to=mlflow: could not start its run: http://mlflow:5000 "):
        tracking.Trackers(cfg, tmp_path, 0, None)
    assert Fake.calls == [("start", None), ("finish", False)]


def test_a_tracker_that_fails_mid_run_is_dropped_with_a_warning(monkeypatch, tmp_path):
    class Flaky(Fake):
        def log(self, values, step):
            if step == 2:
                raise OSError("disk full")
            super().log(values, step)

    Flaky.calls = []
    monkeypatch.setitem(tracking.TRACKERS, "wandb", Flaky)
    said = io.StringIO()
    console = Console(file=said, soft_wrap=True)
    t = tracking.Trackers(load_config("clip", sets=["train.report_to=wandb"]), tmp_path, 0, console)
    for step in (1, 2, 3):
        t.log({"step": step, "total": 1.0})
    t.finish(None, True)
    assert Flaky.calls == [("start", None), (1, ["total"])]
    assert said.getvalue() == ("warning: train.report_to=wandb could not log step 2 (disk full); training goes on "
                               "without it\n")


@pytest.mark.parametrize("name", ["wandb", "mlflow"])
def test_missing_extra_is_one_line_before_out_is_touched(monkeypatch, tmp_path, shards, name):
    monkeypatch.setitem(sys.modules, name, None)  # as if not installed: import and find_spec both fail
    result = run(shards, tmp_path / "out", "--steps", "2", "--set", f"train.report_to=tensorboard,{name}")
    assert result.exit_code == 2
    assert result.output.strip().splitlines()[-1] == (f"error: train.report_to={name} needs {name}: pip install "
                                                      f"'vlprep-vltrain[{name}]'")
    assert not (tmp_path / "out").exists()


# --- real runs --------------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_default_writes_what_it_wrote_before(monkeypatch, tmp_path, shards):
    monkeypatch.chdir(tmp_path)  # a tracker would write its own folder here (./wandb, ./mlruns)
    assert run(shards, tmp_path / "out", "--steps", "2").exit_code == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == [
        ".vlprep.lock", "best.pt", "last.pt", "learning_curve.png", "metrics.jsonl", "result.json", "tb"]
    assert run(shards, tmp_path / "none", "--steps", "2", "--set", "train.report_to=none").exit_code == 0
    assert sorted(p.name for p in (tmp_path / "none").iterdir()) == [
        ".vlprep.lock", "best.pt", "last.pt", "learning_curve.png", "metrics.jsonl", "result.json"]


@pytest.mark.slow
def test_mlflow_gets_every_row_params_and_files_and_a_resume_continues_its_run(monkeypatch, tmp_path, shards):
    from mlflow.tracking import MlflowClient

    # MLflow 3 keeps the file store behind a switch (its default is a database, which mlflow-skinny cannot open)
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", (tmp_path / "mlruns").as_uri())
    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", "tiny")
    monkeypatch.setenv("MLFLOW_DISABLE_TELEMETRY", "true")
    out = tmp_path / "out"
    assert run(shards, out, "--steps", "2", "--set", "train.report_to=mlflow").exit_code == 0
    first = json.loads((out / "tracking.json").read_text())["mlflow"]["id"]
    assert run(shards, out, "--steps", "4", "--resume", "--set", "train.report_to=mlflow").exit_code == 0

    client = MlflowClient()
    experiment = client.get_experiment_by_name("tiny")
    (found,) = client.search_runs([experiment.experiment_id])
    assert found.info.run_id == first
    assert found.info.status == "FINISHED"
    assert found.data.params["batch_size"] == "8"
    assert found.data.params["steps"] == "2"  # MLflow parameters cannot change: the first session's value
    assert found.data.params["train.report_to"] == "['mlflow']"
    expected = expected_history(out)
    assert set(expected) >= {"total", "lr", "val/mean_recall"}
    assert set(found.data.metrics) == set(expected)
    for key, by_step in expected.items():  # every step once, each value as metrics.jsonl has it (exact round trips)
        history = client.get_metric_history(first, key)
        assert sorted((m.step, m.value) for m in history) == sorted(by_step.items()), key
    assert sorted(by_step for by_step in expected["total"]) == [1, 2, 3, 4]
    assert sorted(a.path for a in client.list_artifacts(first)) == ["eval.json", "learning_curve.png"]
    last_val = [r["val"] for r in rows(out) if "val" in r][-1]
    assert json.loads(Path(client.download_artifacts(first, "eval.json", str(tmp_path))).read_text()) == last_val


def wandb_records(path: Path):
    """The records of a W&B run file (LevelDB's log format after a 7-byte W&B header: 32 KiB blocks of records, each
    a 7-byte header of CRC, length and type FULL / FIRST / MIDDLE / LAST), as wandb's protobuf Records."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B"
    pos = 7
    block = 32768
    pending = b""
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if length == 0 and kind == 0:  # zero fill: the rest of the block is empty
            pos += block - pos % block
            continue
        pending += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # FULL or LAST: a whole record
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            pending = b""
            yield record


@pytest.fixture
def wandb_offline(monkeypatch, tmp_path):
    """W&B offline, every folder it writes under tmp_path; its service process stopped after the test."""
    import wandb

    for var, sub in (("WANDB_DIR", "w"), ("WANDB_CONFIG_DIR", "wconfig"), ("WANDB_CACHE_DIR", "wcache"),
                     ("WANDB_DATA_DIR", "wdata")):
        (tmp_path / sub).mkdir()
        monkeypatch.setenv(var, str(tmp_path / sub))
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_PROJECT", "tiny")
    yield tmp_path / "w"
    wandb.teardown()


@pytest.mark.slow
def test_wandb_offline_gets_every_row_and_the_config_and_a_resume_continues_its_run(monkeypatch, tmp_path, shards,
                                                                                     wandb_offline):
    # W&B records the command line unless told not to: a password in it must not reach the run
    monkeypatch.setattr(sys, "argv", ["vltrain", "run", "s3://alice:s3cret@bucket/ds"])
    out = tmp_path / "out"
    assert run(shards, out, "--steps", "2", "--set", "train.report_to=wandb").exit_code == 0
    run_id = json.loads((out / "tracking.json").read_text())["wandb"]["id"]
    assert run(shards, out, "--steps", "4", "--resume", "--set", "train.report_to=wandb").exit_code == 0

    folders = sorted((wandb_offline / "wandb").glob("offline-run-*"))
    assert [f.name.rsplit("-", 1)[1] for f in folders] == [run_id, run_id]  # one tracked run, two sessions
    history = {}
    configs = []
    for folder in folders:
        for record in wandb_records(folder / f"run-{run_id}.wandb"):
            if record.WhichOneof("record_type") == "history":
                items = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in record.history.item}
                for key, value in items.items():
                    if not key.startswith("_"):
                        assert record.history.step.num not in history.setdefault(key, {}), key  # each step once
                        history[key][record.history.step.num] = value
            elif record.WhichOneof("record_type") == "run":
                configs.append({u.key: json.loads(u.value_json) for u in record.run.config.update})
        assert b"s3cret" not in b"".join(p.read_bytes() for p in folder.rglob("*") if p.is_file())
    assert history == expected_history(out)
    assert [c["batch_size"] for c in configs] == [8, 8]
    assert [c["steps"] for c in configs] == [2, 4]  # each session's resolved config
    assert configs[0]["train.report_to"] == ["wandb"]
    files = folders[-1] / "files"
    assert (files / "learning_curve.png").exists()
    assert json.loads((files / "eval.json").read_text()) == [r["val"] for r in rows(out) if "val" in r][-1]
