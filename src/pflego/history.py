"""Run histories and run directories: metrics.jsonl, clients.csv, config, checkpoint, plots."""

from __future__ import annotations

import contextlib
import csv
import json
import math
import os
import tempfile
import zipfile
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import yaml

from pflego.errors import ConfigError

#: The leading columns of ``clients.csv``; an evaluation adds its metric columns after these.
CLIENT_COLUMNS = ["round", "client", "n_train", "n_test"]


def finite_or_none(value: Any) -> Any:
    """NaN and infinities as ``None`` (``null`` in JSON), so logs stay valid JSON."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: finite_or_none(v) for k, v in value.items()}
    if isinstance(value, list):
        return [finite_or_none(v) for v in value]
    return value


@dataclass
class History:
    """What a run measured: one record per evaluation, as in ``metrics.jsonl``.

    Attributes:
        records: Dicts with ``round``, ``algorithm``, ``train_loss``, ``test_acc``,
            ``test_acc_weighted``, ``test_acc_p10``, ``seconds`` and more.
        run_dir: Where the run was written, if anywhere.
    """

    records: list[dict[str, Any]] = field(default_factory=list)
    run_dir: Path | None = None

    def final_window(self, last: int = 1) -> list[dict[str, Any]]:
        """The evaluations a final value averages: those of the last ``last`` rounds.

        Round 0 (the untrained model) is never among them; with ``last`` 0 (or no evaluation in
        the window) the window is the last evaluation after round 0. Empty only when no round
        after 0 was evaluated.
        """
        trained = [r for r in self.records if r["round"] > 0]
        if not trained:
            return []
        final_round = trained[-1]["round"]
        return [r for r in trained if r["round"] > final_round - last] or trained[-1:]

    def final(self, last: int = 1) -> dict[str, float]:
        """Metrics averaged over :meth:`final_window` (the papers' "mean of the last rounds").

        A value logged as ``null`` (non-finite) makes its mean NaN. A run that has only its
        round-0 evaluation reports that evaluation.
        """
        if not self.records:
            return {}
        window = self.final_window(last) or self.records[-1:]
        keys = [
            k
            for k, v in window[-1].items()
            if (v is None or isinstance(v, float)) and k != "seconds"
        ]
        value = lambda r, k: math.nan if r.get(k) is None else r[k]  # noqa: E731
        out = {k: sum(value(r, k) for r in window) / len(window) for k in keys}
        out["seconds"] = self.records[-1]["seconds"]
        return out

    def column(self, key: str) -> tuple[list[int], list[float]]:
        """Rounds and values of one metric, for plotting (``nan`` where it was not finite)."""
        rows = [r for r in self.records if key in r]
        return [r["round"] for r in rows], [math.nan if r[key] is None else r[key] for r in rows]

    @classmethod
    def load(cls, run_dir: str | Path) -> History:
        """Read a run directory's ``metrics.jsonl``."""
        path = Path(run_dir) / "metrics.jsonl"
        if not path.is_file():
            raise ConfigError(f"{run_dir} has no metrics.jsonl; is it a pflego run directory?")
        records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        return cls(records, Path(run_dir))


def check_writable(folder: str | Path, what: str | None = None) -> None:
    """Fail with one line unless ``folder`` is, or can be created as, a writable directory.

    Leaves nothing behind: folders it creates for the check are removed again.
    """
    folder = Path(folder).expanduser()
    created = [p for p in (folder, *folder.parents) if not p.exists()]
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as exc:
        reason = exc.strerror or type(exc).__name__
        raise ConfigError(
            f"cannot write to {what or f'--out {folder}'} ({reason}); choose a writable folder"
        ) from None
    finally:
        for path in created:  # deepest first
            with contextlib.suppress(OSError):
                path.rmdir()


#: Files whose presence makes a folder a run directory that has started (``config.yaml`` alone
#: is a run claimed before its data was loaded: nothing to lose).
RUN_FILES = ("metrics.jsonl", "checkpoint.pt")
#: The ids of a run's tracker runs (``pflego.trackers``), so that a resumed run continues them.
TRACKER_RUNS = "trackers.json"
#: The file that makes a folder an experiment of several runs (reproduce, --seeds, tune).
EXPERIMENT_MANIFEST = "experiment.json"
#: Every file a run writes.
RUN_OUTPUTS = (
    *RUN_FILES,
    TRACKER_RUNS,
    "config.yaml",
    "clients.csv",
    "partition.json",
    "curves.png",
    "profile.json",
)


def check_new_run_dir(out: str | Path, overwrite: bool = False) -> None:
    """Refuse to start a run in a folder that holds one, unless ``overwrite``; check it is writable.

    Raises:
        ConfigError: One line naming ``--resume`` and ``--overwrite``, or the unwritable folder.
    """
    out = Path(out).expanduser()
    if not overwrite and any((out / name).exists() for name in RUN_FILES):
        raise ConfigError(
            f"{out} already holds a run; continue it with `pflego run --resume {out}` "
            "(add --rounds N to extend it), or pass --overwrite to replace it"
        )
    check_writable(out)


def claim_run_dir(out: str | Path, config: dict[str, Any], overwrite: bool = False) -> bool:
    """Check ``out`` (see :func:`check_new_run_dir`) and write its ``config.yaml`` before any data
    is loaded, so that a run stopped at any moment can be resumed (from round 0 when it had no
    checkpoint yet). With ``overwrite``, the files of the run it replaces go first.

    Returns:
        Whether the folder was created (see :func:`release_run_dir`).
    """
    out = Path(out).expanduser()
    check_new_run_dir(out, overwrite)
    created = not out.exists()
    for name in RUN_OUTPUTS if overwrite else ():
        (out / name).unlink(missing_ok=True)
    RunDir(out).write_config(config)
    return created


def release_run_dir(out: str | Path, created: bool) -> None:
    """Undo :func:`claim_run_dir` for a run that failed before it started (nothing to keep)."""
    out = Path(out).expanduser()
    if not any((out / name).exists() for name in RUN_FILES):
        (out / "config.yaml").unlink(missing_ok=True)
        if created:
            with contextlib.suppress(OSError):
                out.rmdir()


def atomic_write(path: Path, write) -> None:
    """Write through a temporary file and rename, so a crash never leaves a half-written file.

    A file that cannot be written (a folder in its place, no permission, a full disk) is a
    one-line ``ConfigError`` naming it; the temporary file is removed.
    """
    tmp = path.with_name(path.name + ".tmp")
    try:
        write(tmp)
        os.replace(tmp, path)
    except OSError as exc:
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)
        raise ConfigError(
            f"cannot write {path} ({exc.strerror or type(exc).__name__}); move what is there "
            "away or choose another folder"
        ) from None


def snapshot(value: Any) -> Any:
    """A copy of nested dicts and lists whose tensors are cloned (later in-place writes to the
    originals do not reach it)."""
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, dict):
        return {k: snapshot(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(snapshot(v) for v in value)
    return value


class CheckpointWriter:
    """Writes checkpoints on a background thread, one at a time, through :func:`atomic_write`.

    :meth:`submit` snapshots the state (so the run can go on changing it), waits for the previous
    write, and returns; the file is replaced only once a write is complete, so a crash at any
    moment leaves the previous checkpoint or the new one, never half of one. :meth:`wait` blocks
    until the last submitted write is on disk (and raises its error, if any).
    """

    def __init__(self, run_dir: RunDir) -> None:
        self.run_dir = run_dir
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="pflego-checkpoint")
        self.pending: Future | None = None

    def submit(self, state: dict[str, Any]) -> None:
        copy = snapshot(state)
        self.wait()
        self.pending = self.pool.submit(self.run_dir.save_checkpoint, copy)

    def wait(self) -> None:
        pending, self.pending = self.pending, None
        if pending is not None:
            pending.result()


class RunDir:
    """The files of one run."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        try:
            self.path.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            reason = exc.strerror or type(exc).__name__
            raise ConfigError(
                f"cannot create the run directory {self.path} ({reason}); choose a writable --out"
            ) from None

    config = property(lambda self: self.path / "config.yaml")
    metrics = property(lambda self: self.path / "metrics.jsonl")
    clients = property(lambda self: self.path / "clients.csv")
    checkpoint = property(lambda self: self.path / "checkpoint.pt")
    partition = property(lambda self: self.path / "partition.json")
    environment = property(lambda self: self.path / "environment.json")

    def start(
        self,
        config: dict[str, Any],
        partition: list[dict[str, Any]],
        environment: dict[str, Any] | None = None,
    ) -> None:
        """Write the resolved config, partition and environment; empty the logs of a fresh run.

        The files of a run this one replaces (its checkpoint, figure and profile) are removed
        first.
        """
        stale_files = ("curves.png", "profile.json", TRACKER_RUNS)
        for stale in (self.checkpoint, *(self.path / name for name in stale_files)):
            if stale.is_dir():
                raise ConfigError(
                    f"{stale} is a folder where a run file goes; move it away or choose another "
                    "folder"
                )
            stale.unlink(missing_ok=True)
        self.write_config(config)
        self.write_partition(partition)
        self.environment.unlink(missing_ok=True)
        if environment is not None:
            self.record_environment(environment)
        self.metrics.write_text("")
        self.clients.write_text("")

    def record_environment(self, environment: dict[str, Any]) -> None:
        """Write ``environment.json``; a resumed run adds its own under ``resumed``."""
        record = environment
        if self.environment.is_file():
            try:
                record = json.loads(self.environment.read_text())
            except ValueError:
                record = {"unreadable": True}
            record.setdefault("resumed", []).append(environment)
        text = json.dumps(finite_or_none(record), indent=1, allow_nan=False)
        atomic_write(self.environment, lambda p: p.write_text(text))

    def record_backend(self, backend: str) -> None:
        """Add to ``environment.json`` the backend that ran the rounds as ``client_backend``
        (``auto`` chooses only in the first round), on a resumption's own entry if any."""
        record = json.loads(self.environment.read_text())
        latest = record["resumed"][-1] if record.get("resumed") else record
        latest["client_backend"] = backend
        text = json.dumps(finite_or_none(record), indent=1, allow_nan=False)
        atomic_write(self.environment, lambda p: p.write_text(text))

    def write_partition(self, partition: list[dict[str, Any]]) -> None:
        atomic_write(self.partition, lambda p: p.write_text(json.dumps(partition)))

    def write_config(self, config: dict[str, Any]) -> None:
        atomic_write(self.config, lambda p: p.write_text(yaml.safe_dump(config, sort_keys=False)))

    def log(self, record: dict[str, Any], rows: list[dict[str, Any]]) -> None:
        """Append one evaluation: a metrics line and a row per client.

        Non-finite values are written as ``null`` (JSON) and ``nan`` (CSV).
        """
        with self.metrics.open("a") as f:
            f.write(json.dumps(finite_or_none(record), allow_nan=False) + "\n")
        with self.clients.open(newline="") as f:
            columns = next(csv.reader(f), None)  # the header; None while the file is empty
        new = columns is None
        if new:
            seen = dict.fromkeys(CLIENT_COLUMNS)
            for row in rows:
                seen |= dict.fromkeys(row)
            columns = list(seen)
        with self.clients.open("a", newline="") as f:
            writer = csv.DictWriter(f, columns, extrasaction="ignore")
            if new:
                writer.writeheader()
            writer.writerows({"round": record["round"], **row} for row in rows)

    def save_checkpoint(self, state: dict[str, Any]) -> None:
        atomic_write(self.checkpoint, lambda p: torch.save(state, p))

    def write_profile(self, profile: dict[str, Any]) -> Path:
        """``profile.json``: where the run's wall-clock time went."""
        path = self.path / "profile.json"
        atomic_write(path, lambda p: p.write_text(json.dumps(profile, indent=1) + "\n"))
        return path

    def load_checkpoint(self) -> dict[str, Any]:
        """The checkpoint, refused with one line unless this pflego's format reads it."""
        from pflego.environment import CHECKPOINT_FORMAT, pflego_version

        if not self.checkpoint.is_file():
            raise ConfigError(f"{self.path} has no checkpoint.pt to resume from")
        try:
            with zipfile.ZipFile(self.checkpoint) as archive:  # torch.load skips the CRC-32s
                damaged = archive.testzip()
            state = None if damaged else torch.load(self.checkpoint, weights_only=False)
        except Exception as exc:  # noqa: BLE001  (any unreadable checkpoint is one user-facing error)
            raise ConfigError(
                f"{self.checkpoint} cannot be read ({type(exc).__name__}); start a new run"
            ) from None
        if damaged:
            raise ConfigError(
                f"{self.checkpoint} is damaged (its part {damaged} fails its checksum); "
                "start a new run"
            )
        if not isinstance(state, dict):
            raise ConfigError(f"{self.checkpoint} is not a pflego checkpoint; start a new run")
        if state.get("format", 1) != CHECKPOINT_FORMAT:
            raise ConfigError(
                f"{self.checkpoint} has checkpoint format {state.get('format', 1)} (written by "
                f"pflego {state.get('pflego', 'before format 2')}), but pflego "
                f"{pflego_version()} resumes only format {CHECKPOINT_FORMAT}; start a new run, "
                "or resume with the pflego that wrote it"
            )
        return state

    def rewind(self, records: list[dict[str, Any]], next_round: int) -> None:
        """Drop log lines written after the checkpoint a resumed run starts from.

        ``metrics.jsonl`` is rewritten from the checkpoint's records; ``clients.csv`` keeps its
        rows of those rounds (a damaged one is a one-line error naming it).
        """
        lines = "".join(json.dumps(finite_or_none(r), allow_nan=False) + "\n" for r in records)
        logged = {r["round"] for r in records}
        try:
            atomic_write(self.metrics, lambda p: p.write_text(lines))
            if not self.clients.exists():
                self.clients.write_text("")
            with self.clients.open(newline="") as f:
                reader = csv.DictReader(f)
                kept = [row for row in reader if int(row["round"]) in logged]
                columns = reader.fieldnames
            if any(None in row or None in row.values() for row in kept):
                raise ValueError("a row's fields do not match the header")
        except (OSError, UnicodeDecodeError, csv.Error, ValueError, KeyError, TypeError) as exc:
            raise ConfigError(
                f"the logs in {self.path} cannot be rewound ({type(exc).__name__}: "
                f"{str(exc).splitlines()[0] if str(exc) else ''}); restore them or start a new run"
            ) from None
        if columns is None:
            return

        def write(path: Path) -> None:
            with path.open("w", newline="") as f:
                writer = csv.DictWriter(f, columns)
                writer.writeheader()
                writer.writerows(kept)

        atomic_write(self.clients, write)
