"""The runs of an experiment: planned from a preset, checked before training, run or resumed.

A :class:`Plan` lists every run (block x row x sweep value x seed) with its resolved config and
its directory, and is written as ``experiment.json`` at the top of the output directory before
anything trains. Executing a plan again finishes it: a run whose ``metrics.jsonl`` reaches its
``rounds`` is kept, an unfinished one resumes from its checkpoint (``pflego.sim.resume``),
and a run that diverged (``diverged.json``) is not retried. Reports are built from the manifest
and the run directories alone, so they can be rebuilt at any time (``pflego report``).
"""

from __future__ import annotations

import dataclasses
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pflego.algorithms.base import check_options, check_settings
from pflego.config import Config, from_dict, read_yaml, to_dict
from pflego.errors import ConfigError, DivergedError
from pflego.experiments.measures import measure_costs, write_costs
from pflego.experiments.parallel import Workers, run_parallel
from pflego.experiments.presets import ALL, Preset, point_label
from pflego.history import EXPERIMENT_MANIFEST, History, atomic_write

MANIFEST = EXPERIMENT_MANIFEST
DIVERGED = "diverged.json"
#: Settings a finished or stopped run may differ in from its plan (``rounds`` only upwards).
RESUMABLE_KEYS = ("data_dir", "device", "divergence", "out", "rounds")


@dataclass(frozen=True)
class PlannedRun:
    """One run of a plan.

    Attributes:
        block: Its block (``all`` when the experiment has none).
        row: The report row it belongs to (rows with ``same_run_as`` share their source's run).
        seed: Its seed.
        sweep: Its sweep value, or ``None``.
        dir: Its directory, relative to the experiment's output directory.
        config: Its resolved settings (``config.yaml``).
    """

    block: str
    row: str
    seed: int
    sweep: Any
    dir: str
    config: dict[str, Any]

    def on_device(self, device: str) -> PlannedRun:
        """The same run on ``device``."""
        return dataclasses.replace(self, config={**self.config, "device": device})


@dataclass
class Plan:
    """An experiment: what a report needs besides the run directories.

    Attributes:
        kind: ``reproduce``, ``compare``, ``runs`` (plain run directories) or ``tune``.
        name: The preset's (or comparison's) name.
        description: One line.
        paper: The paper the preset reproduces.
        source: Where the paper's numbers come from (table, rows, column).
        metric: The default metric (rows may report another).
        blocks: Block names and their overrides (``{"all": {}}`` without blocks).
        rows: ``{"name", "algorithm", "metric", "runs_as"}`` per row, in table order.
        sweep: ``[key, values]`` or ``None``.
        seeds: The seeds every row ran with.
        paper_results: block -> row -> metric -> the paper's number (percent for accuracies).
        paper_std: The paper's standard deviations, laid out as ``paper_results``.
        paper_groups: natural group -> row -> metric -> the paper's number for that group.
        notes: Lines the report states (offline stand-ins, tuning splits, ...).
        tuned: block -> row -> the tuning choice (values, score, budget).
        runs: Every planned run (shared runs appear once per row that reads them).
        target_acc: Accuracy (fraction) whose first round the report gives.
        ranked: The report opens each block with its rows ranked by the metric (a leaderboard).
    """

    kind: str
    name: str
    description: str = ""
    paper: str = ""
    source: str = ""
    metric: str = "test_acc"
    blocks: dict[str, dict[str, Any]] = field(default_factory=lambda: {ALL: {}})
    rows: list[dict[str, Any]] = field(default_factory=list)
    sweep: list[Any] | None = None
    seeds: list[int] = field(default_factory=list)
    paper_results: dict[str, dict[str, dict[str, float]]] = field(default_factory=dict)
    paper_std: dict[str, dict[str, dict[str, float]]] = field(default_factory=dict)
    paper_groups: dict[str, dict[str, dict[str, float]]] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    tuned: dict[str, dict[str, dict[str, Any]]] = field(default_factory=dict)
    runs: list[PlannedRun] = field(default_factory=list)
    target_acc: float | None = None
    ranked: bool = False

    def unique_runs(self) -> list[PlannedRun]:
        """One entry per run directory, in plan order."""
        seen: dict[str, PlannedRun] = {}
        for run in self.runs:
            seen.setdefault(run.dir, run)
        return list(seen.values())

    def runs_of(self, block: str, row: str, sweep: Any = None) -> list[PlannedRun]:
        """A row's runs in one block (and sweep value), one per seed."""
        return [r for r in self.runs if (r.block, r.row, r.sweep) == (block, row, sweep)]

    def sweep_values(self) -> list[Any]:
        return list(self.sweep[1]) if self.sweep else [None]

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=1) + "\n"

    @classmethod
    def from_json(cls, text: str) -> Plan:
        values = json.loads(text)
        values["runs"] = [PlannedRun(**r) for r in values["runs"]]
        return cls(**values)


def run_dir_name(
    preset: Preset,
    block: str,
    row: str,
    sweep_value: Any,
    seed: int,
    seed_dirs: bool,
    row_dirs: bool = True,
) -> str:
    """``<block>/<row>/<key>=<value>/seed-<s>``, leaving out the levels an experiment lacks."""
    parts = [block] if preset.has_blocks else []
    if row_dirs:
        parts.append(preset.rows[row].runs_as)
    if preset.sweep and sweep_value is not None:
        parts.append(point_label({preset.sweep[0]: sweep_value}).replace(", ", "_"))
    if seed_dirs:
        parts.append(f"seed-{seed}")
    return "/".join(parts)


def build_plan(
    preset: Preset,
    kind: str,
    seeds: list[int] | None = None,
    quick: bool = False,
    offline: bool = False,
    overrides: dict[str, Any] | None = None,
    tuned: dict[str, dict[str, dict[str, Any]]] | None = None,
    seed_dirs: bool = True,
    row_dirs: bool = True,
) -> Plan:
    """Every run of ``preset``: rows x blocks x sweep values x seeds, each config checked.

    Args:
        preset: The experiment.
        kind: What the plan is for (``reproduce``, ``compare``, ...).
        seeds: Seeds to run; ``None`` runs each config's own ``seed`` once.
        quick: Apply the preset's ``quick`` overrides.
        offline: Apply the preset's ``offline`` overrides (its stand-in data).
        overrides: Settings from the command line, applied last.
        tuned: block -> row -> ``{"values": settings}`` chosen by tuning.
        seed_dirs: Put each seed in a ``seed-<s>`` directory (always, when ``seeds`` is given).
        row_dirs: Put each row in a directory named after it (off for a single row).

    Raises:
        ConfigError: A config, algorithm name or option is invalid (nothing has run).
    """
    tuned = tuned or {}
    runs = []
    for block in preset.blocks:
        for name, row in preset.rows.items():
            for value in preset.sweep[1] if preset.sweep else [None]:
                chosen = tuned.get(block, {}).get(row.runs_as, {}).get("values")
                values = preset.run_settings(block, name, chosen, quick, offline, value, overrides)
                for seed in seeds if seeds is not None else [None]:
                    config = checked_config(values if seed is None else {**values, "seed": seed})
                    directory = run_dir_name(
                        preset, block, name, value, config.seed, seed_dirs or seeds is not None,
                        row_dirs,
                    )  # fmt: skip
                    runs.append(
                        PlannedRun(block, name, config.seed, value, directory, to_dict(config))
                    )
    compared = not (offline or quick)  # a smoke test or stand-in data: no paper numbers
    return Plan(
        kind=kind,
        name=preset.name,
        description=preset.description,
        paper=preset.paper,
        source=preset.source,
        metric=preset.metric,
        blocks=preset.blocks,
        rows=[
            {"name": n, "algorithm": r.algorithm, "metric": r.metric, "runs_as": r.runs_as}
            for n, r in preset.rows.items()
        ],
        sweep=[preset.sweep[0], preset.sweep[1]] if preset.sweep else None,
        seeds=sorted({r.seed for r in runs}),
        paper_results=preset.paper_results if compared else {},
        paper_std=preset.paper_std if compared else {},
        paper_groups=preset.paper_groups if compared else {},
        notes=plan_notes(preset, quick, offline, overrides),
        tuned={b: dict(t) for b, t in tuned.items()},
        runs=runs,
        ranked=preset.ranked,
    )


def plan_notes(
    preset: Preset, quick: bool, offline: bool, overrides: dict[str, Any] | None
) -> list[str]:
    """The lines a report states about how a plan departs from the preset (stand-in data,
    command-line settings, the quick form)."""
    notes = []
    if offline and preset.offline:
        notes.append(
            f"Offline form: {point_label(preset.offline)} replaces the preset's data "
            f"({', '.join(preset.data) or preset.settings.get('dataset', '?')}); these numbers "
            "check the machinery and are not comparable with the paper's."
        )
    shown = {k: v for k, v in (overrides or {}).items() if k != "data_dir"}
    if shown:
        notes.append(f"Set on the command line for every run: {point_label(shown)}.")
    if quick and preset.quick:
        notes.append(f"Quick form ({point_label(preset.quick)}): a smoke test, not a reproduction.")
    return notes


def checked_config(values: dict[str, Any]) -> Config:
    """A validated config whose algorithm, options, dataset and model names all exist, with the
    step sizes resolved as the run's ``config.yaml`` will record them."""
    from pflego.algorithms import ALGORITHMS
    from pflego.data import dataset_info
    from pflego.models import architecture
    from pflego.sim import with_step_sizes

    config = from_dict(values)
    check_options(config.algorithm, config.options)
    check_settings(config)
    dataset_info(config.dataset)
    if config.model != "auto":
        architecture(config.model)
    return with_step_sizes(config, ALGORITHMS[config.algorithm])


#: The settings that decide a run's data and partition.
PARTITION_KEYS = (
    "dataset",
    "data_dir",
    "partition",
    "classes_per_client",
    "alpha",
    "min_client_size",
    "test_fraction",
    "val_fraction",
    "pachinko_beta",
    "clients",
    "unseen_fraction",
    "seed",
    "model",
)


def check_data(plan: Plan) -> None:
    """Load every dataset and build every distinct partition (and model) of the plan once.

    Missing files, and settings the data cannot satisfy (more classes per client than the dataset
    has, too few clients to cover its classes), stop the plan before any training, with the
    loader's or the partition's one-line error.
    """
    from pflego.sim import build_experiment

    checked = set()
    for run in plan.unique_runs():
        key = tuple(repr(run.config.get(k)) for k in PARTITION_KEYS)
        if key not in checked:
            checked.add(key)
            build_experiment(from_dict(run.config))


def run_status(path: Path, config: dict[str, Any]) -> str:
    """``new``, ``done``, ``diverged``, ``resume`` or ``restart`` (no checkpoint) for a planned run.

    Raises:
        ConfigError: The directory holds a run with other settings.
    """
    if not (path / "config.yaml").is_file():
        return "new"
    stored = read_yaml(path / "config.yaml")
    differs = sorted(  # an unset (None) planned value may be stored resolved (default step sizes)
        k
        for k in set(stored) | set(config)
        if k not in RESUMABLE_KEYS
        and stored.get(k) != config.get(k)
        and not (config.get(k) is None and k in stored)
    )
    if differs:
        key = differs[0]
        raise ConfigError(
            f"{path} holds a run with {key}={stored.get(key)!r}, not {config.get(key)!r}; "
            "use another --out"
        )
    if stored["rounds"] > config["rounds"]:
        raise ConfigError(
            f"{path} holds a run of {stored['rounds']} rounds, more than the {config['rounds']} "
            f"asked for; pass --rounds {stored['rounds']} or use another --out"
        )
    if (path / DIVERGED).is_file():
        return "diverged"
    records = History.load(path).records if (path / "metrics.jsonl").is_file() else []
    if records and records[-1]["round"] == config["rounds"] == stored["rounds"]:
        return "done"
    return "resume" if (path / "checkpoint.pt").is_file() else "restart"


def execute(plan: Plan, out: Path, progress: bool = True, workers: Workers | None = None) -> None:
    """Run every unfinished run of ``plan`` under ``out`` (written there as ``experiment.json``).

    Every run's state is checked before the first one trains. A run that diverges is recorded in
    its ``diverged.json`` and the others go on. With ``workers``, the runs are spread over
    ``workers.jobs`` processes (:mod:`pflego.experiments.parallel`).
    """
    runs = plan.unique_runs()
    statuses = [run_status(out / r.dir, r.config) for r in runs]
    try:
        out.mkdir(parents=True, exist_ok=True)
        atomic_write(out / MANIFEST, lambda p: p.write_text(plan.to_json()))
    except OSError as exc:
        raise ConfigError(
            f"cannot write to --out {out} ({exc.strerror or type(exc).__name__}); "
            "choose a writable folder"
        ) from None
    todo = [(r, s) for r, s in zip(runs, statuses) if s not in ("done", "diverged")]
    if workers is not None and (workers.jobs > 1 or workers.devices):
        run_parallel(todo, out, workers, progress, run_planned)
        return
    for k, (run, status) in enumerate(todo, 1):
        if progress:
            print(f"pflego: run {k} of {len(todo)}: {run.dir} ({status})", file=sys.stderr)
        run_planned(out, run, status, progress)


def run_planned(out: Path, run: PlannedRun, status: str, progress: bool) -> str:
    """Run, resume or restart one planned run (``status``); ``done``, or ``diverged`` when it
    diverged (recorded in its ``diverged.json``)."""
    from pflego.sim import build_experiment, resume, run_experiment

    path = out / run.dir
    try:
        if status == "resume":
            resume(path, progress, rounds=run.config["rounds"])
        else:
            experiment = build_experiment(from_dict(run.config))
            path.mkdir(parents=True, exist_ok=True)
            write_costs(path, measure_costs(experiment))
            run_experiment(experiment, path, progress)
    except DivergedError as exc:
        (path / DIVERGED).write_text(json.dumps({"message": str(exc)}) + "\n")
        print(f"pflego: warning: {run.dir} diverged: {exc}", file=sys.stderr)
        return "diverged"
    return "done"


def read_manifest(out: str | Path) -> Plan:
    path = Path(out) / MANIFEST
    if not path.is_file():
        raise ConfigError(f"{out} has no {MANIFEST}; is it a pflego experiment directory?")
    try:
        return Plan.from_json(path.read_text())
    except (ValueError, TypeError, KeyError):
        raise ConfigError(f"{path} cannot be read; rerun the experiment into a new --out") from None
