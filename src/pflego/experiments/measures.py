"""What a report measures, computed from the evaluations every run already logs.

Names follow ``metrics.jsonl``: an accuracy key ends in ``acc`` (or carries a view suffix, e.g.
``test_acc_global``) and is a fraction in files, shown in percent in tables. The final value of a
metric is the mean of the evaluations in the last ``average_last`` rounds
(:meth:`History.final_window`), never including round 0.
"""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.flop_counter import FlopCounterMode

from pflego.history import History

COSTS_FILE = "costs.json"


def is_accuracy(metric: str) -> bool:
    """Whether a metrics.jsonl key is an accuracy or a difference of accuracies (a fraction, shown
    in percent)."""
    return "_acc" in metric or metric.startswith(("acc", "participation_gap"))


def companion(metric: str, stat: str) -> str:
    """The key of a statistic of an accuracy metric: ``test_acc_global`` + ``p10`` ->
    ``test_acc_p10_global`` (eval.summarize puts the statistic before the view suffix)."""
    head, sep, view = metric.partition("_acc")
    return f"{head}_acc_{stat}{view}" if sep else metric


def participation_gap_key(metric: str) -> str | None:
    """The participation gap of a test accuracy's view (``test_acc_global`` or
    ``unseen_test_acc_global`` -> ``participation_gap_global``); ``None`` for other metrics."""
    head, sep, view = metric.partition("_acc")
    return f"participation_gap{view}" if sep and head in ("test", "unseen_test") else None


def validation_metric(metric: str) -> str:
    """The validation counterpart of a test metric (``unseen_test_acc`` -> ``unseen_val_acc``)."""
    return metric.replace("test_", "val_", 1)


def value(record: dict[str, Any], key: str) -> float:
    """A record's value as a float (NaN when absent or logged as null)."""
    v = record.get(key)
    return math.nan if v is None else float(v)


def final_value(history: History, key: str, last: int) -> float:
    """Mean of ``key`` over the final window (the last ``last`` rounds, round 0 never included)."""
    window = history.final_window(last)
    return float(np.mean([value(r, key) for r in window])) if window else math.nan


def best_validation(history: History, metric: str) -> tuple[int, float] | None:
    """``(round, test value)`` at the evaluation after round 0 with the best validation value.

    The first such round wins ties. ``None`` when the run logged no validation metric.
    """
    val = validation_metric(metric)
    rows = [r for r in history.records if r["round"] > 0 and r.get(val) is not None]
    if not rows:
        return None
    best = max(rows, key=lambda r: r[val])  # max keeps the first of equal values
    return best["round"], value(best, metric)


def rounds_to_target(history: History, metric: str, target: float) -> int | None:
    """The first evaluated round whose ``metric`` reaches ``target`` (a fraction), or ``None``."""
    for record in history.records:
        if value(record, metric) >= target:
            return int(record["round"])
    return None


def final_client_values(run_dir: Path, metric: str, last: int) -> dict[int, float]:
    """Each client's final value of ``metric`` (its mean over the final window's evaluations),
    from clients.csv.

    A metric named ``unseen_<m>`` reads column ``<m>`` of the clients that never trained;
    any other metric, its own column for the clients that trained.
    """
    rounds = {r["round"] for r in History.load(run_dir).final_window(last)}
    unseen = metric.startswith("unseen_")
    column = metric[len("unseen_") :] if unseen else metric
    sums: dict[int, list[float]] = {}
    with (run_dir / "clients.csv").open(newline="") as f:
        for row in csv.DictReader(f):
            if int(row["round"]) not in rounds or row.get(column) in (None, ""):
                continue
            if (row.get("unseen") in ("1", "1.0", "True")) != unseen:
                continue
            sums.setdefault(int(row["client"]), []).append(float(row[column]))
    return {client: float(np.mean(v)) for client, v in sums.items()}


def gain_over_local(
    run_dir: str | Path, local_dir: str | Path, metric: str, last: int
) -> tuple[float, float] | None:
    """Mean and standard deviation over clients of (this run's final value - local's), per client.

    Both runs must have the same partition (``partition.json``) and seed; ``None`` otherwise.
    """
    run_dir, local_dir = Path(run_dir), Path(local_dir)
    if (run_dir / "partition.json").read_text() != (local_dir / "partition.json").read_text():
        return None
    ours, local = (final_client_values(d, metric, last) for d in (run_dir, local_dir))
    gains = [ours[c] - local[c] for c in ours if c in local]
    if not gains:
        return None
    return float(np.mean(gains)), float(np.std(gains))


def group_values(run_dir: str | Path, metric: str, last: int) -> dict[str, float]:
    """Mean over each natural group's clients (``group`` in partition.json) of their final value."""
    run_dir = Path(run_dir)
    partition = json.loads((run_dir / "partition.json").read_text())
    group_of = {row["client"]: str(row["group"]) for row in partition if "group" in row}
    by_group: dict[str, list[float]] = {}
    for client, v in final_client_values(run_dir, metric, last).items():
        if client in group_of:
            by_group.setdefault(group_of[client], []).append(v)
    return {g: float(np.mean(v)) for g, v in by_group.items()}


def _bytes(tree: dict[str, torch.Tensor]) -> int:
    return sum(v.numel() * v.element_size() for v in tree.values())


def measure_costs(experiment) -> dict[str, float]:
    """Communication and client computation of one round, measured on round 0 of a fresh copy.

    Runs the cohort of round 0 through the loop backend once (nothing is stored; the fused
    backend's steps run outside autograd, where the counter would miss their backward products) and counts the bytes
    of the downlink payload each client receives and of the upload each client sends (parameter
    tensors only), and the FLOPs of the cohort's client updates (``torch.utils.flop_counter``:
    matrix products and convolutions). Per round = per client x the expected cohort size r.
    Evaluation traffic is not counted.
    """
    from pflego.sim import Simulation
    from pflego.sim.backends import loop_backend

    sim = Simulation(experiment, None)
    t = next((t for t in range(experiment.config.rounds) if len(sim.cohort(t))), 0)
    ctx, cohort = sim.context(t), sim.cohort(t)  # round 0, or the first non-empty Bernoulli draw
    sent = sim.algorithm.send(sim.server, ctx, torch.as_tensor(cohort))
    downlink = sent.payload
    states, inputs = sim.states(cohort, downlink, ctx), sim.round_inputs(t, cohort)
    with FlopCounterMode(display=False) as counter:  # the loop backend: no padding, and every
        out, _ = loop_backend(sim.algorithm, downlink, states, inputs, ctx)  # step through autograd
    n = max(1, len(cohort))
    down = _bytes(downlink) / (n if sent.per_client else 1)
    up = _bytes(out.upload) / n
    r = ctx.cohort_size
    return {
        "bytes_down_per_client": down,
        "bytes_up_per_client": up,
        "bytes_down_per_round": down * r,
        "bytes_up_per_round": up * r,
        "client_flops_per_round": counter.get_total_flops() / n,
        "cohort_size": r,
    }


def write_costs(run_dir: Path, costs: dict[str, float]) -> None:
    (Path(run_dir) / COSTS_FILE).write_text(json.dumps(costs, indent=1) + "\n")


def read_costs(run_dir: Path) -> dict[str, float] | None:
    path = Path(run_dir) / COSTS_FILE
    return json.loads(path.read_text()) if path.is_file() else None
