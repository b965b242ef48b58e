"""Experiment trackers: TensorBoard, MLflow and Weights & Biases, fed what a run directory gets.

The ``log`` setting names them (comma-separated). A tracker run is one pflego run: its settings
as hyperparameters, every evaluation's numbers under their ``metrics.jsonl`` names with the round
as the step, and at the end its ``config.yaml`` and figures as artifacts. Everything is written
offline: TensorBoard event files, MLflow's local file store, W&B's offline mode.

Where (see :class:`Placement`): beside the run (``<run>/tensorboard``, ``<run>/mlruns``,
``<run>/wandb``), or, for a run inside an experiment folder (``reproduce``, ``--seeds``, ``tune``,
``compare``), beside the experiment, one tracker run per pflego run, grouped by the experiment's
name (the MLflow experiment, the W&B group; TensorBoard shows each run by its path under the
experiment's folder); under ``log_dir`` when it is set. ``$MLFLOW_TRACKING_URI`` and
``$WANDB_PROJECT`` are honoured. The tracker run ids are kept in the run's ``trackers.json``,
so that a resumed run continues the same tracker runs.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import secrets
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from pflego.config import tracker_names
from pflego.history import EXPERIMENT_MANIFEST, TRACKER_RUNS, RunDir, atomic_write

#: The project of W&B runs when ``$WANDB_PROJECT`` is unset (and the MLflow experiment of a run
#: outside an experiment folder).
PROJECT = "pflego"
#: The files of a run directory logged as artifacts when it ends, if present.
ARTIFACTS = ("config.yaml", "curves.png", "report.md", "report.png")


def metrics_of(record: dict[str, Any]) -> dict[str, float]:
    """A record's numbers under their ``metrics.jsonl`` names (not ``round``, the step);
    ``null`` (non-finite) as NaN."""
    return {
        key: math.nan if value is None else float(value)
        for key, value in record.items()
        if key != "round" and (value is None or type(value) in (int, float))
    }


def hyperparameters(config: dict[str, Any], prefix: str = "") -> dict[str, str | float | bool]:
    """The config flattened (``options.mu``) to values every tracker takes; ``None`` as text."""
    flat: dict[str, str | float | bool] = {}
    for key, value in config.items():
        if isinstance(value, dict):
            flat |= hyperparameters(value, f"{prefix}{key}.")
        else:
            flat[prefix + key] = value if isinstance(value, int | float | bool) else str(value)
    return flat


@dataclass(frozen=True)
class Placement:
    """Where a pflego run's tracker runs go.

    Attributes:
        run_dir: The run directory.
        log_dir: The ``log_dir`` setting, if set.
        experiment: The experiment folder that holds the run (an ``experiment.json``), if any.
        group: The experiment's name (its preset's, else its folder's), or ``None`` for a lone run.
        name: The run's name: its path inside the experiment, or its folder's name.
    """

    run_dir: Path
    log_dir: Path | None
    experiment: Path | None
    group: str | None
    name: str

    @property
    def root(self) -> Path:
        """The folder that holds MLflow's store and W&B's runs: ``log_dir``, else the
        experiment's folder, else the run's."""
        return self.log_dir or self.experiment or self.run_dir

    @classmethod
    def of(cls, run_dir: Path, log_dir: str | None) -> Placement:
        run_dir = run_dir.resolve()
        experiment = next((p for p in run_dir.parents if (p / EXPERIMENT_MANIFEST).is_file()), None)
        group, name = None, run_dir.name
        if experiment is not None:
            name = run_dir.relative_to(experiment).as_posix()
            try:
                group = str(json.loads((experiment / EXPERIMENT_MANIFEST).read_text())["name"])
            except (OSError, ValueError, KeyError, TypeError):
                group = experiment.name
        return cls(
            run_dir, Path(log_dir).expanduser() if log_dir else None, experiment, group, name
        )


class Tracker(Protocol):
    """One tracker run of one pflego run."""

    #: The id that continues this tracker run (``None``: the place itself identifies it).
    run_id: str | None

    def log_metrics(self, metrics: dict[str, float], step: int) -> None: ...

    def log_artifacts(self, paths: list[Path]) -> None: ...

    def close(self) -> None: ...


class TensorBoardTracker:
    """Event files through torch's ``SummaryWriter`` (it needs the ``tensorboard`` package, which
    viewing them needs anyway): ``<run>/tensorboard``, or ``<log_dir>/tensorboard/<group>/<name>``.

    A resumed run's writer purges the steps after the last evaluation it kept, so evaluations
    logged after the checkpoint it resumes from are not shown twice.
    """

    def __init__(self, place: Placement, config: dict[str, Any], resumed_after: int | None):
        from torch.utils.tensorboard import SummaryWriter

        folder = place.run_dir / "tensorboard"
        if place.log_dir is not None:
            folder = place.log_dir / "tensorboard" / (place.group or PROJECT) / place.name
        first = 0 if resumed_after is None else resumed_after + 1
        self.writer = SummaryWriter(str(folder), purge_step=first)
        self.run_id = None
        if resumed_after is None:
            from torch.utils.tensorboard.summary import hparams

            for summary in hparams(hyperparameters(config), {}):
                self.writer.file_writer.add_summary(summary)

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        for key, value in metrics.items():
            self.writer.add_scalar(key, value, step)
        self.writer.flush()

    def log_artifacts(self, paths: list[Path]) -> None:
        for path in paths:
            if path.suffix == ".md":
                self.writer.add_text(path.name, path.read_text())
            elif path.suffix == ".png":
                import numpy as np
                from PIL import Image

                image = np.asarray(Image.open(path).convert("RGB"))
                self.writer.add_image(path.name, image, 0, dataformats="HWC")

    def close(self) -> None:
        self.writer.close()


class MLflowTracker:
    """A run of MLflow's local file store (``file:<root>/mlruns``, or ``$MLFLOW_TRACKING_URI``),
    in the experiment named after the pflego experiment (``pflego`` for a lone run)."""

    def __init__(self, place: Placement, config: dict[str, Any], run_id: str | None):
        from mlflow.entities import Metric, Param
        from mlflow.tracking import MlflowClient

        uri = os.environ.get("MLFLOW_TRACKING_URI")
        if not uri:
            uri = (place.root / "mlruns").resolve().as_uri()
            # MLflow 3 keeps its file store for those who ask for it: pflego's offline store
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        self.metric = Metric
        self.client = MlflowClient(tracking_uri=uri)
        if run_id is None:
            experiment = self.experiment_id(place.group or PROJECT)
            run = self.client.create_run(experiment, run_name=place.name)
            run_id = run.info.run_id
            params = [Param(k, str(v)) for k, v in hyperparameters(config).items()]
            self.client.log_batch(run_id, params=params)
        else:
            self.client.update_run(run_id, status="RUNNING")
        self.run_id = run_id

    def experiment_id(self, name: str) -> str:
        """The id of the MLflow experiment ``name``, created if missing (by this or a parallel
        worker: a failed creation looks it up again)."""
        found = self.client.get_experiment_by_name(name)
        if found is not None:
            return found.experiment_id
        try:
            return self.client.create_experiment(name)
        except Exception:  # noqa: BLE001  (another worker created it first)
            found = self.client.get_experiment_by_name(name)
            if found is None:
                raise
            return found.experiment_id

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        stamp = int(time.time() * 1000)
        batch = [self.metric(k, v, stamp, step) for k, v in metrics.items()]
        self.client.log_batch(self.run_id, metrics=batch)

    def log_artifacts(self, paths: list[Path]) -> None:
        for path in paths:
            self.client.log_artifact(self.run_id, str(path))

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


class WandbTracker:
    """A W&B run in offline mode only (``<root>/wandb/offline-run-*``; ``wandb sync`` uploads
    it), in the project ``$WANDB_PROJECT`` or ``pflego``, grouped by the experiment."""

    def __init__(self, place: Placement, config: dict[str, Any], run_id: str | None):
        import wandb

        place.root.mkdir(parents=True, exist_ok=True)
        self.run = wandb.init(
            project=os.environ.get("WANDB_PROJECT") or PROJECT,
            dir=str(place.root),
            id=run_id or secrets.token_hex(4),
            resume="allow",
            mode="offline",
            group=place.group,
            name=place.name,
            config=hyperparameters(config) if run_id is None else None,
            settings=wandb.Settings(silent=True, console="off", x_disable_stats=True),
            reinit="create_new",
        )
        self.run_id = self.run.id

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        self.run.log(metrics, step=step)

    def log_artifacts(self, paths: list[Path]) -> None:
        for path in paths:
            self.run.save(str(path), base_path=str(path.parent), policy="now")

    def close(self) -> None:
        self.run.finish()


#: tracker name -> its class; each is built from (placement, config, id or resumed-after step).
TRACKER_CLASSES = {
    "tensorboard": TensorBoardTracker,
    "mlflow": MLflowTracker,
    "wandb": WandbTracker,
}


def open_trackers(
    run_dir: RunDir, config: dict[str, Any], resumed_after: int | None
) -> list[Tracker]:
    """Start (or, with ``resumed_after`` the round of the last kept evaluation, continue) the
    tracker runs that ``config["log"]`` names, and record their ids in ``trackers.json``."""
    names = tracker_names(config.get("log"))
    if not names:
        return []
    path = run_dir.path / TRACKER_RUNS
    ids: dict[str, Any] = {}
    if resumed_after is not None and path.is_file():
        with contextlib.suppress(ValueError):
            ids = json.loads(path.read_text())
    place = Placement.of(run_dir.path, config.get("log_dir"))
    opened: list[Tracker] = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # MLflow's file store is in maintenance
        for name in names:
            known = ids.get(name) if resumed_after is not None else None
            start = resumed_after if name == "tensorboard" else known
            opened.append(TRACKER_CLASSES[name](place, config, start))
            ids[name] = opened[-1].run_id
    atomic_write(path, lambda p: p.write_text(json.dumps(ids, indent=1) + "\n"))
    return opened
