"""Experiment trackers (``--log``): what each one wrote, read back with its own reader, equals
``metrics.jsonl`` over a run and its resumed extension; the flag and its one-line errors."""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path

import pytest
from conftest import TINY

import pflego.config
import pflego.sim.rounds
import pflego.trackers
from pflego.cli import build_parser, main
from pflego.cli.flags import settings_from_args
from pflego.config import load_config
from pflego.errors import ConfigError
from pflego.history import History
from pflego.sim import resume, run
from pflego.trackers import Placement, metrics_of

SETTINGS = {**TINY, "rounds": 3, "eval_every": 1, "algorithm": "fedavg"}


def expected(run_dir: Path) -> dict[str, dict[int, float]]:
    """metric -> round -> value, from metrics.jsonl (an independent reading of what was logged)."""
    out: dict[str, dict[int, float]] = {}
    for record in History.load(run_dir).records:
        for key, value in metrics_of(record).items():
            out.setdefault(key, {})[record["round"]] = value
    return out


def same(logged: dict[str, dict[int, float]], run_dir: Path, rel: float = 1e-12) -> None:
    want = expected(run_dir)
    assert set(want) == set(logged) and "test_acc" in want and "train_loss" in want
    for key, values in want.items():
        assert sorted(logged[key]) == sorted(values) == list(range(6)), key
        for step, value in values.items():
            got = logged[key][step]
            assert (math.isnan(got) and math.isnan(value)) or math.isclose(got, value, rel_tol=rel)


def train_and_extend(tmp_path: Path, log: str) -> Path:
    """A 3-round run with the tracker, then the same run resumed and extended to 5 rounds."""
    out = tmp_path / "run"
    run({**SETTINGS, "log": log}, out=out, progress=False)
    resume(out, progress=False, rounds=5)
    assert History.load(out).records[-1]["round"] == 5
    return out


@pytest.mark.slow
def test_tensorboard_event_files_hold_every_evaluation(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out = train_and_extend(tmp_path, "tensorboard")
    events = EventAccumulator(str(out / "tensorboard"), size_guidance={"scalars": 0}).Reload()
    tags = events.Tags()
    logged = {k: {e.step: e.value for e in events.Scalars(k)} for k in tags["scalars"]}
    same(logged, out, rel=1e-6)  # event files hold float32
    assert "curves.png" in tags["images"]


@pytest.mark.slow
def test_mlflow_file_store_holds_every_evaluation_in_one_run(tmp_path, monkeypatch):
    pytest.importorskip("mlflow")
    from mlflow.tracking import MlflowClient

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    out = train_and_extend(tmp_path, "mlflow")
    run_id = json.loads((out / "trackers.json").read_text())["mlflow"]
    client = MlflowClient(tracking_uri=(out / "mlruns").as_uri())
    runs = client.search_runs([client.get_experiment_by_name("pflego").experiment_id])
    assert [r.info.run_id for r in runs] == [run_id]  # the resumed run continued it
    stored = client.get_run(run_id)
    logged = {
        key: {m.step: m.value for m in client.get_metric_history(run_id, key)}
        for key in stored.data.metrics
    }
    same(logged, out)
    assert stored.data.params["algorithm"] == "fedavg" and stored.data.params["rounds"] == "3"
    assert stored.info.status == "FINISHED" and stored.info.run_name == "run"
    artifacts = {a.path for a in client.list_artifacts(run_id)}
    assert {"config.yaml", "curves.png"} <= artifacts


def wandb_records(path: Path) -> list:
    """The protobuf records of a W&B run file (``run-<id>.wandb``): a 7-byte header, then
    LevelDB log records in 32 KiB blocks (CRC-32C, length, type; type 1 whole, 2-4 split)."""
    from wandb.proto import wandb_internal_pb2

    data, block = path.read_bytes(), 32768
    assert data[:4] == b":W&B"
    records, pending, at = [], b"", 7
    while at + 7 <= len(data):
        room = block - at % block
        if room < 7:  # a block's tail too short for a header is padding
            at += room
            continue
        _, length, kind = struct.unpack("<IHB", data[at : at + 7])
        if kind == 0:
            break
        pending += data[at + 7 : at + 7 + length]
        at += 7 + length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            records.append(record)
            pending = b""
    return records


@pytest.mark.slow
def test_wandb_offline_run_files_hold_every_evaluation_under_one_id(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_SILENT", "true")
    out = train_and_extend(tmp_path, "wandb")
    run_id = json.loads((out / "trackers.json").read_text())["wandb"]
    files = sorted((out / "wandb").glob("offline-run-*/run-*.wandb"))
    assert [f.name for f in files] == [f"run-{run_id}.wandb"] * 2  # the run, then its resumption
    logged: dict[str, dict[int, float]] = {}
    config, saved = {}, set()
    for record in (r for f in files for r in wandb_records(f)):
        kind = record.WhichOneof("record_type")
        if kind == "history":
            items = {
                i.key or "/".join(i.nested_key): json.loads(i.value_json)
                for i in record.history.item
            }
            step = record.history.step.num
            for key, value in items.items():
                if not key.startswith("_"):
                    logged.setdefault(key, {})[step] = value if value is not None else math.nan
        elif kind == "files":
            saved |= {f.path for f in record.files.files}
        elif kind == "run":  # the run's start, with its config
            assert record.run.run_id == run_id and record.run.display_name == "run"
            config |= {i.key: json.loads(i.value_json) for i in record.run.config.update}
    for key, values in logged.items():  # W&B writes NaN as the string "NaN"
        logged[key] = {s: math.nan if v == "NaN" else v for s, v in values.items()}
    same(logged, out)
    assert config["algorithm"] == "fedavg" and config["rounds"] == 3
    assert {"curves.png", "config.yaml"} <= saved


class FakeTracker:
    """A tracker that notes in ``LOG`` what it is given."""

    LOG: list[tuple] = []

    def __init__(self, place: Placement, config: dict, run_id: str | None) -> None:
        self.run_id = run_id or "fake-1"
        self.LOG.append(("open", run_id))

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        self.LOG.append(("metrics", step))

    def log_artifacts(self, paths: list[Path]) -> None:
        self.LOG.append(("artifacts", sorted(p.name for p in paths)))

    def close(self) -> None:
        self.LOG.append(("close",))


@pytest.fixture
def fake_tracker(monkeypatch) -> list[tuple]:
    """``log=mlflow`` opens a :class:`FakeTracker` (whatever this machine has installed)."""
    monkeypatch.setitem(pflego.config.TRACKERS, "mlflow", "json")
    monkeypatch.setitem(pflego.trackers.TRACKER_CLASSES, "mlflow", FakeTracker)
    monkeypatch.setattr(FakeTracker, "LOG", [])
    return FakeTracker.LOG


def test_a_tracker_gets_every_evaluation_then_the_artifacts_and_a_resumption_continues_it(
    tmp_path, fake_tracker
):
    out = tmp_path / "run"
    run({**SETTINGS, "log": "mlflow"}, out=out, progress=False)
    done = [("artifacts", ["config.yaml", "curves.png"]), ("close",)]
    assert fake_tracker == [("open", None), *[("metrics", t) for t in range(4)], *done]
    fake_tracker.clear()
    resume(out, progress=False, rounds=5)
    assert fake_tracker == [("open", "fake-1"), ("metrics", 4), ("metrics", 5), *done]


def test_a_run_that_fails_closes_its_trackers_without_artifacts(
    tmp_path, fake_tracker, monkeypatch
):
    run_round = pflego.sim.rounds.Simulation.run_round

    def failing(self, t):
        if t == 1:
            raise RuntimeError("the round failed")
        run_round(self, t)

    monkeypatch.setattr(pflego.sim.rounds.Simulation, "run_round", failing)
    with pytest.raises(RuntimeError, match="the round failed"):
        run({**SETTINGS, "log": "mlflow"}, out=tmp_path / "run", progress=False)
    assert fake_tracker == [("open", None), ("metrics", 0), ("metrics", 1), ("close",)]


def test_log_flag_reaches_the_settings_of_run_and_reproduce():
    parser = build_parser()
    args = parser.parse_args(["run", "--log", "tensorboard,mlflow"])
    assert settings_from_args(args) == {"log": "tensorboard,mlflow"}
    args = parser.parse_args(["reproduce", "main", "--log", "wandb", "--set", "rounds=2"])
    assert settings_from_args(args) == {"log": "wandb", "rounds": 2}


def test_an_unknown_tracker_is_one_line(capsys, tmp_path):
    code = main(["run", "--log", "tensorboard,neptune", "--out", str(tmp_path / "r"), "--quiet"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1
    assert "'neptune' is not a tracker; choose from tensorboard, mlflow, wandb" in err
    assert not (tmp_path / "r").exists()


def test_a_missing_tracker_package_names_its_extra(monkeypatch):
    import importlib.machinery
    import importlib.util

    def find_spec(name):  # every tracker installed but MLflow, whatever this machine has
        return None if name == "mlflow" else importlib.machinery.ModuleSpec(name, None)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)
    with pytest.raises(ConfigError, match=r"log=mlflow needs the mlflow package: pip install "):
        load_config(log="tensorboard, mlflow")
    assert load_config(log="tensorboard").log == "tensorboard"


def test_runs_of_an_experiment_are_grouped_by_its_name(tmp_path):
    (tmp_path / "exp" / "all" / "pflego" / "seed-1").mkdir(parents=True)
    (tmp_path / "exp" / "experiment.json").write_text(json.dumps({"name": "pflego-mnist"}))
    place = Placement.of(tmp_path / "exp" / "all" / "pflego" / "seed-1", None)
    assert (place.group, place.name) == ("pflego-mnist", "all/pflego/seed-1")
    assert place.root == (tmp_path / "exp").resolve()
    lone = Placement.of(tmp_path / "lone", str(tmp_path / "logs"))
    assert (lone.group, lone.name, lone.root) == (None, "lone", tmp_path / "logs")


def test_metrics_are_the_numbers_of_a_record_and_round_is_the_step():
    record = {"round": 2, "algorithm": "fedavg", "test_acc": 0.5, "n": 3, "x": None}
    record |= {"adapted": True, "dropped": [[1, 2]]}
    values = metrics_of(record)
    assert values.keys() == {"test_acc", "n", "x"} and math.isnan(values["x"])
