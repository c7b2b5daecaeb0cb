"""Experiment trackers for `train.report_to` (W&B, MLflow): every metrics.jsonl row, the resolved config as the
run's parameters, the run's figures and last held-out evaluation as files at its end. A resumed run goes on in the
same tracked run: each tracker's run id, and the last row it got, are kept in OUT/tracking.json."""

import importlib.util
import json
import os
import shutil
import tempfile
import time
from pathlib import Path

from vlprep import cut
from vlprep.urls import redact_text
from vltrain.config import to_dict
from vltrain.errors import TrainError

STATE = "tracking.json"
FIGURES = ("learning_curve.png", "curriculum.png", "curriculum.json")
PARAM_CHARS = 6000  # MLflow refuses a longer parameter value


def missing_extra(name: str) -> str:
    return f"train.report_to={name} needs {name}: pip install 'vlprep-vltrain[{name}]'"


def check_installed(names: list[str]) -> None:
    """A TrainError naming the extra for the first tracker in `names` whose package is not installed."""
    for name in names:
        if name in TRACKERS and importlib.util.find_spec(TRACKERS[name].module) is None:
            raise TrainError(missing_extra(name))


def params(cfg) -> dict:
    """The resolved config flattened to dotted keys, every URL in it redacted (shards may hold user:pass@)."""
    flat = {}

    def walk(d: dict, prefix: str) -> None:
        for key, value in d.items():
            if isinstance(value, dict) and value:
                walk(value, f"{prefix}{key}.")
            else:
                flat[prefix + key] = value

    walk(json.loads(redact_text(json.dumps(to_dict(cfg)))), "")
    return flat


def metrics(row: dict, prefix: str = "") -> dict:
    """A metrics.jsonl row's numbers under its own keys, nested ones joined with / (val/mean_recall); no step."""
    found = {}
    for key, value in row.items():
        if key == "step" and not prefix:
            continue
        if isinstance(value, dict):
            found.update(metrics(value, f"{prefix}{key}/"))
        elif isinstance(value, (int, float)):  # lists and words (probs, task) are no metric; a bool counts as 0 / 1
            found[prefix + key] = float(value)
    return found


def kind(row: dict) -> str:
    """Which of the rows that share a step this is: a held-out evaluation, a curriculum check or the training row."""
    return "val" if "val" in row else "curriculum" if "curriculum" in row else "train"


class Wandb:
    """A W&B run (WANDB_PROJECT, WANDB_ENTITY, WANDB_MODE... from the environment)."""

    module = "wandb"

    def start(self, config: dict, name: str, resume_id: str | None) -> str:
        import wandb

        # x_disable_meta: W&B would record the command line, which may hold a shard URL's password
        self.run = wandb.init(id=resume_id, resume="allow" if resume_id else None, config=config,
                              name=None if os.environ.get("WANDB_NAME") else name, reinit="create_new",
                              settings=wandb.Settings(x_disable_meta=True))
        return self.run.id

    def log(self, values: dict, step: int) -> None:
        self.run.log(values, step=step)

    def artifact(self, path: Path) -> None:
        kept = Path(self.run.dir) / path.name  # files in the run's folder are what W&B uploads
        shutil.copyfile(path, kept)
        self.run.save(str(kept), base_path=self.run.dir, policy="now")

    def finish(self, ok: bool) -> None:
        self.run.finish(exit_code=0 if ok else 1)


class Mlflow:
    """An MLflow run (MLFLOW_TRACKING_URI, MLFLOW_EXPERIMENT_NAME or _ID from the environment). Its parameters
    cannot change, so a resume that changes a key (steps) keeps the first value there."""

    module = "mlflow"

    def start(self, config: dict, name: str, resume_id: str | None) -> str:
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient

        self.client = MlflowClient()
        if resume_id is not None:
            self.client.update_run(resume_id, status="RUNNING")
            self.run_id = resume_id
            known = self.client.get_run(resume_id).data.params
        else:
            self.run_id = self.client.create_run(self._experiment(), run_name=name).info.run_id
            known = {}
        self.client.log_batch(self.run_id, params=[Param(k, cut(str(v), PARAM_CHARS)) for k, v in config.items()
                                                   if k not in known])
        return self.run_id

    def _experiment(self) -> str:
        name = os.environ.get("MLFLOW_EXPERIMENT_NAME")
        if not name:
            return os.environ.get("MLFLOW_EXPERIMENT_ID", "0")  # "0": the store's Default experiment
        found = self.client.get_experiment_by_name(name)
        return found.experiment_id if found is not None else self.client.create_experiment(name)

    def log(self, values: dict, step: int) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[Metric(k, v, now, step) for k, v in values.items()])

    def artifact(self, path: Path) -> None:
        self.client.log_artifact(self.run_id, str(path))

    def finish(self, ok: bool) -> None:
        self.client.set_terminated(self.run_id, "FINISHED" if ok else "FAILED")


TRACKERS = {"wandb": Wandb, "mlflow": Mlflow}


class Trackers:
    """The run's W&B and MLflow runs (none on ranks other than 0, which do not log), behind one log / finish."""

    def __init__(self, cfg, out: Path, rank: int, console):
        self.out = out
        self.console = console
        self.active = {name: TRACKERS[name]() for name in cfg.train.report_to if name in TRACKERS} if rank == 0 else {}
        self.state = {}
        if not self.active:
            return
        check_installed(list(self.active))
        self.state = read_state(out / STATE)
        config = params(cfg)
        started = {}
        for name, tracker in self.active.items():
            record = self.state.get(name) or {}
            try:
                run_id = tracker.start(config, out.resolve().name, record.get("id"))
            except Exception as e:  # a tracker's own error (no login, an unreachable server): one line, before step 1
                self.active = started
                self.finish(None, False)
                raise TrainError(missing_extra(name) if isinstance(e, ImportError) else
                                 f"train.report_to={name}: could not start its run: {_line(e)}") from None
            started[name] = tracker
            self.state[name] = {"id": run_id, "step": record.get("step", -1), "kinds": record.get("kinds", [])}
        self._save()

    def log(self, row: dict) -> None:
        """Send `row` to each tracker that has not had it (a resumed run redoes the steps after its checkpoint)."""
        step = row["step"]
        for name, tracker in list(self.active.items()):
            record = self.state[name]
            if step < record["step"] or (step == record["step"] and kind(row) in record["kinds"]):
                continue
            values = metrics(row)
            try:
                if values:
                    tracker.log(values, step)
            except Exception as e:  # a tracker that fails mid-run is left, not the training
                self._drop(name, f"could not log step {step} ({_line(e)}); training goes on without it")
                continue
            record["kinds"] = (record["kinds"] if step == record["step"] else []) + [kind(row)]
            record["step"] = step
        if self.active:
            self._save()

    def finish(self, last_eval: dict | None, ok: bool) -> None:
        """The figures and the last held-out evaluation (as eval.json) uploaded, each tracked run ended."""
        with tempfile.TemporaryDirectory() as tmp:
            files = [self.out / name for name in FIGURES if (self.out / name).exists()]
            if last_eval is not None:
                files.append(Path(tmp) / "eval.json")
                files[-1].write_text(json.dumps(last_eval, indent=2) + "\n")
            for name, tracker in list(self.active.items()):
                try:
                    for path in files:
                        tracker.artifact(path)
                    tracker.finish(ok)
                except Exception as e:
                    self._drop(name, f"could not upload its files or end its run ({_line(e)})")
        self.active = {}

    def _drop(self, name: str, what: str) -> None:
        self.active.pop(name)
        self.console.print(f"warning: train.report_to={name} {what}", style="yellow", highlight=False, markup=False)

    def _save(self) -> None:
        path = self.out / STATE
        tmp = path.with_name(STATE + ".tmp")
        tmp.write_text(json.dumps(self.state) + "\n")
        os.replace(tmp, path)


def read_state(path: Path) -> dict:
    """OUT/tracking.json ({tracker: {id, step, kinds}}), {} when absent; a TrainError when it is not such JSON."""
    if not path.exists():
        return {}
    try:
        state = json.loads(path.read_text())
    except (ValueError, UnicodeDecodeError):
        state = None
    if not isinstance(state, dict) or not all(isinstance(r, dict) and {"id", "step", "kinds"} <= set(r)
                                              for r in state.values()):
        raise TrainError(f"{path}: not the tracked runs' ids (JSON); delete it to start new tracked runs")
    return state


def _line(e: Exception) -> str:
    text = str(e).strip().splitlines()
    return cut(redact_text(text[0] if text else type(e).__name__), 200)
