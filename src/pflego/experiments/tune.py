"""Tuning on validation data: a grid, the same budget for every method, test data never read.

Every grid point runs the same number of rounds on the same tuning seeds; its score is the final
value (mean of the evaluations of the last ``average_last`` rounds, round 0 never included) of the
validation metric, averaged over the tuning seeds. The choice reads only validation metrics: the
test split could hold anything without changing it (``tests/test_experiments.py`` poisons it).
A point that diverges, on any tuning seed, scores NaN and is never chosen; ties go to the first
point in grid order.

Why a plain grid and not Optuna: see ``docs/experiments.md`` ("Why a grid, not Optuna",
measured with ``benchmarks/optuna_vs_grid.py``). In short, the grids are small (8 points) and made
of the discrete candidates the papers and the reference code use; at such budgets Optuna's TPE
sampler draws at random with repeats and did worse than the grid (worst-case regret 1.75 vs 0.09
percentage points on PFLEGO's step sizes); a grid is also deterministic, and each of its points is
an ordinary run directory that resumes and reports like any other.
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from pflego.errors import ConfigError
from pflego.experiments import measures as M
from pflego.experiments.parallel import Workers
from pflego.experiments.presets import (
    ALL,
    DEFAULT_METRIC,
    Preset,
    Row,
    assignment,
    flatten,
    grid_points,
    merge,
    one_row,
    point_label,
)
from pflego.experiments.runs import DIVERGED, Plan, build_plan, check_data, execute
from pflego.experiments.seeds import mean_std
from pflego.history import History

#: Validation share used for tuning when the settings hold out none.
DEFAULT_VAL_FRACTION = 0.1


@dataclass
class Tuning:
    """One tuning job: a base setting, a grid and where its runs go.

    Attributes:
        base: The settings every point starts from (an ``algorithm`` among them).
        grid: ``(key, values)`` dimensions (see :func:`~pflego.experiments.presets.grid_points`).
        seeds: The tuning seeds.
        out: Its directory: ``tune.md``, ``chosen.yaml`` and the grid's runs in ``grid/p01/``...
        metric: The test metric the final runs report; the score is its validation counterpart.
        title: Heading of ``tune.md``.
    """

    base: dict[str, Any]
    grid: list[tuple[str, list[Any]]]
    seeds: list[int]
    out: Path
    metric: str = "test_acc"
    title: str = ""

    @property
    def runs_root(self) -> Path:
        """Where the grid's run directories go."""
        return self.out / "grid"

    @property
    def points(self) -> list[dict[str, Any]]:
        return grid_points(self.grid)

    @property
    def score_metric(self) -> str:
        return M.validation_metric(self.metric)

    def plan(self) -> Plan:
        """The grid's runs (every config checked), with a note when tuning adds a validation
        split."""
        base, notes = self.base, []
        if not float(base.get("val_fraction") or 0.0) > 0:
            base = {**base, "val_fraction": DEFAULT_VAL_FRACTION}
            notes.append(
                f"The settings hold out no validation data, so tuning holds out "
                f"val_fraction={DEFAULT_VAL_FRACTION} of each client's training samples; the "
                "final runs train on the whole training split again."
            )
        rows = {
            f"p{k:02d}": Row(f"p{k:02d}", base["algorithm"], point, self.score_metric)
            for k, point in enumerate(self.points, 1)
        }
        preset = Preset(
            name=self.title or "tuning", settings=base, rows=rows, metric=self.score_metric
        )
        plan = build_plan(preset, "tune", self.seeds)
        plan.notes = notes
        return plan


@dataclass
class PointScore:
    """A grid point's validation scores."""

    name: str
    values: dict[str, Any]
    per_seed: list[float]
    status: list[str]

    @property
    def score(self) -> float:
        mean, _ = mean_std(self.per_seed)
        return mean


def score_points(tuning: Tuning, plan: Plan) -> list[PointScore]:
    """Every point's validation score, read from its runs' validation metrics only."""
    scores = []
    for k, point in enumerate(tuning.points, 1):
        name = f"p{k:02d}"
        per_seed, status = [], []
        for run in plan.runs_of(ALL, name):
            path = tuning.runs_root / run.dir
            history = History.load(path) if (path / "metrics.jsonl").is_file() else History()
            diverged = (path / DIVERGED).is_file()
            value = M.final_value(history, tuning.score_metric, run.config["average_last"])
            per_seed.append(math.nan if diverged else value)
            status.append(
                "diverged"
                if diverged
                else ("" if not math.isnan(value) else "no validation metric")
            )
        scores.append(PointScore(name, point, per_seed, status))
    return scores


def choose(scores: list[PointScore]) -> PointScore:
    """The point with the best finite mean validation score (the first of equals)."""
    finite = [s for s in scores if not math.isnan(s.score)]
    if not finite:
        raise ConfigError(
            "every grid point diverged or logged no validation metric; widen the grid towards "
            "smaller step sizes"
        )
    return max(finite, key=lambda s: s.score)


def edge_notes(grid: list[tuple[str, list[Any]]], chosen: dict[str, Any]) -> list[str]:
    """A note for each numeric grid dimension (three values or more) whose chosen value is its
    smallest or largest: the best value may lie beyond the grid."""
    values_chosen = flatten(chosen)
    notes = []
    for name, values in grid:
        numeric = all(type(v) in (int, float) for v in values)
        if len(values) < 3 or not numeric or name not in values_chosen:
            continue
        value, ends = values_chosen[name], {min(values): "smallest", max(values): "largest"}
        if value in ends:
            notes.append(
                f"{name}={value} is the {ends[value]} value of its grid; a grid reaching "
                "beyond it may choose better"
            )
    return notes


def run_tuning(
    tuning: Tuning, progress: bool = True, workers: Workers | None = None
) -> dict[str, Any]:
    """Run (or finish) a grid whose data the caller checked (:func:`check_data` of its plan),
    choose on validation data, write ``tune.md`` and ``chosen.yaml``.

    Returns:
        ``{"values", "label", "score", "metric", "points", "report", "settings", "edges"}``: the
        chosen point, its validation score, the grid size, ``tune.md``'s path, the full settings
        and the notes of :func:`edge_notes`.
    """
    plan = tuning.plan()
    for note in plan.notes:
        print(f"pflego: tune: {note}", file=sys.stderr)
    execute(plan, tuning.runs_root, progress, workers)
    scores = score_points(tuning, plan)
    best = choose(scores)
    chosen_settings = merge(tuning.base, best.values)
    (tuning.out / "chosen.yaml").write_text(
        "# Chosen by `pflego tune` on validation data; see tune.md\n"
        + yaml.safe_dump(chosen_settings, sort_keys=False)
    )
    edges = edge_notes(tuning.grid, best.values)
    for note in edges:
        print(f"pflego: tune: {note}", file=sys.stderr)
    (tuning.out / "tune.md").write_text(render_tune(tuning, plan, scores, best, edges))
    return {
        "values": best.values,
        "label": point_label(best.values),
        "score": best.score,
        "metric": tuning.score_metric,
        "points": len(scores),
        "report": "tune.md",
        "settings": chosen_settings,
        "edges": edges,
    }


def render_tune(
    tuning: Tuning,
    plan: Plan,
    scores: list[PointScore],
    best: PointScore,
    edges: list[str],
) -> str:
    """``tune.md``: every grid point's validation score, the choice and :func:`edge_notes`."""
    from pflego.experiments.report_tables import fmt, md_table

    metric = tuning.score_metric
    first = plan.runs[0].config
    seeds = sorted({r.seed for r in plan.runs})
    lines = [f"# {tuning.title or 'Tuning'}", ""]
    lines.append(
        f"Selection: `{metric}` ({M.is_accuracy(metric) and 'percent' or 'as logged'}), the final "
        f"value of each run (mean of the evaluations of the last {first['average_last']} rounds, "
        f"round 0 never included), averaged over the tuning seeds {', '.join(map(str, seeds))}; "
        "the highest mean wins, the first of equals. Test metrics are never read."
    )
    lines.append(
        f"Budget: {len(scores)} grid points × {len(seeds)} seed(s) × {first['rounds']} rounds; "
        "a point that diverges on any seed is never chosen."
    )
    lines += [f"- {n}" for n in plan.notes]
    lines.append("")
    flat = [flatten(s.values) for s in scores]
    keys = list(dict.fromkeys(k for f in flat for k in f))
    header = ["point", *keys, f"{metric} (mean)", *(f"seed {s}" for s in seeds), "status"]
    cells = []
    for s, values in zip(scores, flat):
        cells.append(
            [
                f"**{s.name} (chosen)**" if s is best else s.name,
                *(str(values.get(k, "")) for k in keys),
                fmt(s.score, metric),
                *(fmt(v, metric) for v in s.per_seed),
                "; ".join(x for x in s.status if x) or "ok",
            ]
        )
    lines += md_table(header, cells)
    lines += [
        "",
        f"Chosen: {point_label(best.values)} ({metric} {fmt(best.score, metric)}). Full settings: chosen.yaml.",
        "",
        *(line for note in edges for line in (f"Note: {note}.", "")),
    ]
    return "\n".join(lines)


def parse_grid(specs: list[str]) -> list[tuple[str, list[Any]]]:
    """``--grid`` flags as grid dimensions.

    ``client_lr=0.01,0.03`` is one setting and its values (YAML scalars); ``options.mu=0.1,1``
    an algorithm option; ``server_optimizer+server_lr=sgd/0.1,adam/0.001`` a joint dimension whose
    values set several settings together.
    """
    from pflego.experiments.presets import check_key

    grid = []
    for spec in specs:
        key, sep, raw = spec.partition("=")
        if not sep or not key or not raw:
            raise ConfigError(f"--grid {spec!r} must look like key=v1,v2 (e.g. client_lr=0.01,0.1)")
        keys = key.split("+")
        for k in keys:
            check_key(k, f"--grid {spec}")
        values = []
        for item in raw.split(","):
            parts = item.split("/")
            if len(parts) != len(keys):
                raise ConfigError(
                    f"--grid {spec!r}: value {item!r} must give {len(keys)} parts joined by '/'"
                )
            parsed = [yaml.safe_load(part) for part in parts]
            values.append(
                parsed[0]
                if len(keys) == 1
                else merge(*(assignment(k, v) for k, v in zip(keys, parsed)))
            )
        grid.append((key, values))
    if not grid:
        raise ConfigError("give at least one --grid key=v1,v2")
    return grid


def tune(
    settings: dict[str, Any],
    grid: list[tuple[str, list[Any]]],
    seeds: list[int] | None = None,
    tune_seeds: list[int] | None = None,
    out: str | Path | None = None,
    progress: bool = True,
    workers: Workers | None = None,
    overwrite: bool = False,
) -> tuple[dict[str, Any], str]:
    """``pflego tune``: run a grid on validation data, choose, rerun the choice on ``seeds``.

    Args:
        settings: The setting (``algorithm`` among them) every grid point starts from.
        grid: The grid (see :func:`parse_grid`).
        seeds: Seeds of the final runs of the chosen setting (default ``[0]``).
        tune_seeds: Seeds of the grid runs (default ``[0]``).
        out: Output directory (default ``runs/tune-<algorithm>-<time>``): ``tune.md``,
            ``chosen.yaml``, ``grid/`` (the grid's runs), ``final/`` (the chosen setting's runs
            and their report).
        progress: Progress bars.
        workers: Run the runs in parallel processes (``--jobs``, ``--devices``).
        overwrite: Replace whatever pflego wrote in ``out`` (by default a folder that holds
            anything of pflego's but a tuning to finish is refused).

    Returns:
        The choice (see :func:`run_tuning`) and the final runs' main table.
    """
    from pflego.config import load_config, to_dict
    from pflego.experiments.folders import check_out, clear_out, stamp
    from pflego.experiments.report import write_report

    base = to_dict(load_config(settings))
    algorithm = base["algorithm"]
    root = Path(out or Path("runs") / f"tune-{algorithm}-{stamp()}")
    title = f"Tuning {algorithm} on {base['dataset']}"
    job = Tuning(base, grid, tune_seeds or [0], root, DEFAULT_METRIC, title)
    check_out(root, "tuning", overwrite, continues=True)
    grid_plan = job.plan()  # checks every point before anything trains
    check_data(grid_plan)
    if overwrite:
        clear_out(root)
    choice = run_tuning(job, progress, workers)
    final = one_row(f"{algorithm} with the tuned setting", choice["settings"])
    plan = build_plan(final, "tune", seeds or [0], row_dirs=False)
    shown = {k: v for k, v in choice.items() if k != "settings"}
    plan.tuned = {ALL: {algorithm: {**shown, "report": "../tune.md"}}}
    execute(plan, root / "final", progress, workers)
    report = write_report(root / "final")
    with (root / "tune.md").open("a") as f:
        f.write(
            "## Test accuracy of the chosen setting\n\n"
            f"Retrained with the chosen values on seeds {', '.join(map(str, plan.seeds))} "
            "(report: final/report.md):\n\n" + report.summary() + "\n"
        )
    return choice, report.summary()
