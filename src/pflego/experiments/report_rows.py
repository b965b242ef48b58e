"""The rows of a report, read from an experiment's run directories.

A report has one row per planned row, block and sweep value; :func:`collect` reads each row's
run directories (one per seed) and keeps what the tables, ``report.csv`` and the figures show
(:class:`SeedResult`), with each run's status (done, partial, diverged or missing).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from pflego.experiments import measures as M
from pflego.experiments.presets import point_label
from pflego.experiments.runs import DIVERGED, Plan, PlannedRun
from pflego.experiments.seeds import mean_std
from pflego.history import History


@dataclass
class SeedResult:
    """One run's numbers for a row (one seed)."""

    seed: int
    path: Path
    status: str  # done | partial (round r of T) | diverged | missing
    final: float = math.nan
    p10: float = math.nan
    p90: float = math.nan
    client_std: float = math.nan  # the standard deviation over clients
    gap: float = math.nan  # the participation gap
    weighted: float = math.nan
    train_loss: float = math.nan
    seconds: float = math.nan
    last_round: int = 0
    window: tuple[int, int, int] | None = None  # (evaluations, first round, last round)
    best_val: tuple[int, float] | None = None
    to_target: int | None = None
    gain: tuple[float, float] | None = None
    costs: dict[str, float] | None = None
    history: History | None = None


@dataclass
class RowResult:
    """A report row: one row of the experiment in one block (and sweep value), over its seeds."""

    block: str
    name: str
    algorithm: str
    metric: str
    sweep: Any
    paper: float | None
    sweep_key: str | None = None
    paper_std: float | None = None
    seeds: list[SeedResult] = field(default_factory=list)
    settings: dict[str, Any] = field(default_factory=dict)

    @property
    def label(self) -> str:
        return self.name if self.sweep is None else f"{self.name} ({self.sweep_label})"

    @property
    def marked(self) -> str:
        """The label with what kept runs from finishing, as every table and legend shows it:
        ``fedavg (diverged)``, ``fedavg (diverged in 1 of 3 seeds)``."""
        bad = [s.status.split(" ")[0] for s in self.seeds if s.status != "done"]
        if not bad:
            return self.label
        count = "" if len(bad) == len(self.seeds) else f" in {len(bad)} of {len(self.seeds)} seeds"
        return f"{self.label} ({', '.join(dict.fromkeys(bad))}{count})"

    @property
    def sweep_label(self) -> str:
        """``inner_steps=5`` for a sweep row, else empty."""
        return "" if self.sweep is None else point_label({self.sweep_key: self.sweep})

    def stat(self, attr: str) -> tuple[float, float]:
        return mean_std([getattr(s, attr) for s in self.seeds])

    @property
    def paper_fraction(self) -> float | None:
        """The paper's number on our scale (a fraction for accuracies), or ``None``."""
        if self.paper is None:
            return None
        return self.paper / (100 if M.is_accuracy(self.metric) else 1)

    def difference(self) -> float | None:
        """Our mean final value minus the paper's number (on our scale), or ``None``."""
        paper = self.paper_fraction
        return None if paper is None else self.stat("final")[0] - paper

    def best_validations(self) -> list[tuple[int, float]]:
        """``(round, test value)`` at the best-validation round of each seed that has one."""
        return [s.best_val for s in self.seeds if s.best_val]

    def reached(self) -> list[int]:
        """The rounds to the target accuracy of the seeds that reach it."""
        return [s.to_target for s in self.seeds if s.to_target is not None]

    def gain(self) -> tuple[float, float] | None:
        """Gain over ``local``: its mean and its std over clients, each averaged over seeds."""
        gains = [s.gain for s in self.seeds if s.gain]
        if not gains:
            return None
        return float(np.mean([g[0] for g in gains])), float(np.mean([g[1] for g in gains]))

    def cost(self, key: str) -> float | None:
        """A cost per round (``bytes_up_per_round``...), averaged over the seeds that measured it."""
        costs = [s.costs for s in self.seeds if s.costs]
        return float(np.mean([c[key] for c in costs])) if costs else None


def logged(rows: list[RowResult], attr: str) -> bool:
    """Whether some run of ``rows`` has a number (not NaN) for ``attr`` (``p90``, ``gap``...)."""
    return any(not math.isnan(getattr(s, attr)) for r in rows for s in r.seeds)


def rows_by_block(plan: Plan, rows: list[RowResult]) -> dict[str, list[RowResult]]:
    """The rows of each block that has any, in the plan's order of blocks and of rows."""
    grouped = {block: [r for r in rows if r.block == block] for block in plan.blocks}
    return {block: members for block, members in grouped.items() if members}


def collect(plan: Plan, root: Path, target_acc: float | None = None) -> list[RowResult]:
    """Every report row's numbers, read from the run directories under ``root``."""
    cache: dict[str, History | None] = {}
    rows: list[RowResult] = []
    local_row = next((r["name"] for r in plan.rows if r["algorithm"] == "local"), None)
    local_dirs = {(r.block, r.sweep, r.seed): root / r.dir for r in plan.runs if r.row == local_row}
    for block in plan.blocks:
        for spec in plan.rows:
            for sweep in plan.sweep_values():
                runs = plan.runs_of(block, spec["name"], sweep)
                if not runs:
                    continue
                name, metric = spec["name"], spec["metric"]
                row = RowResult(
                    block,
                    name,
                    spec["algorithm"],
                    metric,
                    sweep,
                    plan.paper_results.get(block, {}).get(name, {}).get(metric),
                    plan.sweep[0] if plan.sweep else None,
                    plan.paper_std.get(block, {}).get(name, {}).get(metric),
                    settings=runs[0].config,
                )
                for run in runs:
                    local = local_dirs.get((block, sweep, run.seed))
                    if spec["algorithm"] == "local":
                        local = None
                    row.seeds.append(seed_result(run, root, metric, target_acc, cache, local))
                rows.append(row)
    return rows


def seed_result(
    run: PlannedRun,
    root: Path,
    metric: str,
    target_acc: float | None,
    cache: dict[str, History | None],
    local: Path | None,
) -> SeedResult:
    """The numbers of one run directory (for a row's metric)."""
    path = root / run.dir
    if run.dir not in cache:
        cache[run.dir] = History.load(path) if (path / "metrics.jsonl").is_file() else None
    history = cache[run.dir]
    result = SeedResult(run.seed, path, "missing", history=history)
    if history is None or not history.records:
        return result
    last = run.config["average_last"]
    rounds = run.config["rounds"]
    window = history.final_window(last)
    result.last_round = history.records[-1]["round"]
    if (path / DIVERGED).is_file():
        result.status = "diverged"
    elif result.last_round < rounds:
        result.status = f"partial (round {result.last_round} of {rounds})"
    else:
        result.status = "done"
    if window:
        result.window = (len(window), window[0]["round"], window[-1]["round"])
    result.final = M.final_value(history, metric, last)
    result.p10 = M.final_value(history, M.companion(metric, "p10"), last)
    result.weighted = M.final_value(history, M.companion(metric, "weighted"), last)
    if M.companion(metric, "p90") != metric:  # an accuracy
        result.p90 = M.final_value(history, M.companion(metric, "p90"), last)
        result.client_std = M.final_value(history, M.companion(metric, "std"), last)
    if gap := M.participation_gap_key(metric):
        result.gap = M.final_value(history, gap, last)
    result.train_loss = M.final_value(history, "train_loss", last)
    result.seconds = M.value(history.records[-1], "seconds")
    result.best_val = M.best_validation(history, metric)
    if target_acc is not None:
        result.to_target = M.rounds_to_target(history, metric, target_acc)
    if local is not None and (local / "clients.csv").is_file() and window:
        result.gain = M.gain_over_local(path, local, metric, last)
    result.costs = M.read_costs(path)
    return result
