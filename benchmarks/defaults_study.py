"""Default step sizes that never diverge and are never far from the best, chosen across settings.

For every algorithm and every setting (a small but varied federation), a ``pflego tune`` grid of
step sizes runs on validation data (test data is never read); each cell (algorithm × setting)
is one tuning directory, so a rerun skips the points already finished. Then, per algorithm, the
grid point whose worst relative regret over the settings is smallest is chosen: a point's regret
in a setting is ``(best - value) / best`` with ``best`` the setting's best grid point and
``value`` its mean validation accuracy of the last rounds; a diverged point's regret is 1.

Usage::

    PYTHONPATH=src python benchmarks/defaults_study.py --data-dir /work/shared/data \\
        [--algorithms pflego,fedavg] [--settings mnist5k-k2,synthetic] [--rounds 20] \\
        [--runs runs/defaults] [--results results/defaults]

Writes ``<results>/study.json`` (every point's validation accuracy and final training loss),
``<results>/report.md`` and each cell's ``tune.md`` / ``chosen.yaml`` in ``<results>/<cell>/``;
the grids' run directories stay under ``--runs``.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import time
from pathlib import Path
from typing import Any

import torch

from pflego.algorithms import ALGORITHMS
from pflego.algorithms.base import hyperparameters
from pflego.config import load_config, to_dict
from pflego.experiments import measures as M
from pflego.experiments.presets import ALL, point_label
from pflego.experiments.tune import Tuning, parse_grid, run_tuning, score_points
from pflego.history import History

#: Settings every tuning run shares: 20 rounds, evaluations at rounds 5..20, the score the mean
#: of the evaluations at rounds 15 and 20 on 10% of each client's training samples.
COMMON = {
    "rounds": 20,
    "eval_every": 5,
    "average_last": 10,
    "val_fraction": 0.1,
    "seed": 0,
    "checkpoint_every": 1000,
}

#: The settings of this machine's budget for the methods beyond the first sitting: the cheapest
#: (about 2.5 CPU s a FedAvg point each, mnist5k-k2 9.4) whose best step sizes still disagree.
CHEAP_SETTINGS = ("mnist5k-20", "fedem-synthetic")
#: The next cheapest, run only where those two would move a default: the main experiment's
#: tau = 50, where a large client step size is most at risk.
CONFIRM_SETTING = "mnist5k-k2"

#: The federations, cheapest first. ``data`` marks those that read --data-dir.
SETTINGS: dict[str, dict[str, Any]] = {
    # the main experiment: 5,000 MNIST images, 50 clients of K = 2 classes, tau = 50 full batches
    "mnist5k-k2": {
        "dataset": "mnist5k",
        "partition": "classes",
        "classes_per_client": 2,
        "clients": 50,
        "participation": 0.2,
        "inner_steps": 50,
    },
    # where the main experiment's PFLEGO beta = rho = 1 diverged (docs/experiments.md, "Why a grid,
    # not Optuna"): 20 clients of K = 2 classes, 4 a round, tau = 10
    "mnist5k-20": {
        "dataset": "mnist5k",
        "partition": "classes",
        "classes_per_client": 2,
        "clients": 20,
        "participation": 0.2,
        "inner_steps": 10,
    },
    # pFedMe's synthetic set with its linear model: 20 steps of batch 20, 10% participation
    "synthetic": {
        "dataset": "synthetic",
        "model": "linear",
        "clients": 100,
        "participation": 0.1,
        "inner_steps": 20,
        "batch_size": 20,
    },
    # FedEM's synthetic mixture (300 natural clients, linear): one epoch of batch 128
    "fedem-synthetic": {
        "dataset": "fedem-synthetic",
        "partition": "natural",
        "model": "linear",
        "clients": 300,
        "participation": 0.1,
        "local_epochs": 1.0,
        "batch_size": 128,
    },
    # full MNIST, Dirichlet(0.3) over 100 clients, one epoch of batch 10 (the MLP)
    "mnist-dir0.3": {
        "dataset": "mnist",
        "data": True,
        "partition": "dirichlet",
        "alpha": 0.3,
        "clients": 100,
        "participation": 0.2,
        "local_epochs": 1.0,
        "batch_size": 10,
    },
    # full MNIST, 100 clients of K = 2 classes, tau = 50 full batches: the fmnist case
    # (10 rounds: its rounds cost ten times the others'; the issue's run diverged by round 10)
    "mnist-k2-100": {
        "dataset": "mnist",
        "rounds": 10,
        "data": True,
        "partition": "classes",
        "classes_per_client": 2,
        "clients": 100,
        "participation": 0.2,
        "inner_steps": 50,
    },
}

#: The grids of the first sitting (pflego, fedavg, fedper over the six settings); every other
#: algorithm's grid is made by ``default_grid`` from its defaults.
CLIENT_LR = "client_lr=0.01,0.03,0.1,0.3,1.0"
GRIDS: dict[str, list[str]] = {
    "pflego": [
        "client_lr=0.03,0.1,0.3,1.0",
        "server_optimizer+server_lr=sgd/0.1,sgd/1.0,adam/0.001,adam/0.003",
    ],
    "fedavg": [CLIENT_LR],
    "fedper": [CLIENT_LR],
    # its first grid (default_grid's, 0.0001-0.01 around the old 0.001, alpha crossed at 0.001)
    # chose its top, 0.01; this one starts at 0.001 with alpha crossed at 0.01 (its runs made
    # afresh), and grew twice more, new points last, as its choice reached an edge (0.1, then
    # alpha 0.03) until the choice was inside
    "perfedavg": [
        "client_lr+options.alpha=0.001/0.005,0.003/0.005,0.01/0.005,0.03/0.005,0.1/0.005,"
        "0.01/0.003,0.01/0.01,0.3/0.005,1.0/0.005,0.1/0.01,0.1/0.03,0.1/0.1,0.3/0.03,0.03/0.03"
    ],
}

#: PFLEGO's defaults before the first sitting changed them (the others' are read from the
#: registry when an algorithm's first cell runs, and kept in study.json: a study started afresh
#: records today's defaults as the old ones).
OLD_DEFAULTS: dict[str, dict[str, Any]] = {
    "pflego": {"client_lr": 1.0, "server_optimizer": "sgd", "server_lr": 1.0},
    "perfedavg": {"client_lr": 0.001, "options": {"alpha": 0.005}},
}

#: Step sizes of an algorithm's own besides ``client_lr`` (an option of its dataclass), tuned
#: along with it. Ditto's personal steps and APFL's alpha steps take ``client_lr`` itself.
SECOND_STEP: dict[str, str] = {
    "apple": "dr_lr",
    "fedala": "eta",
    "fedas": "align_lr",
    "perfedavg": "alpha",
    "pfedhn": "hyper_lr",
    "pfedme": "personal_lr",
}

#: Algorithms without a step size to choose: MOCHA's SDCA steps take none.
NO_STEP_SIZE = ("mocha",)

#: The study's order: results/leaderboard-mnist-offline/report.md's ranking, so that the
#: methods most likely to be used finish first (registered methods missing here come last).
LEADERBOARD = [
    "fedbn",
    "fedavg+",
    "fedphp",
    "knn-per",
    "ditto",
    "fedrod",
    "pgfed",
    "pgfedmo",
    "fedper",
    "pgfed-ce",
    "apple",
    "apfl",
    "fedala",
    "gpfl",
    "pfedhn",
    "fedbabu",
    "fedpac",
    "cfl",
    "fedcac",
    "fedrep",
    "fedamp",
    "fedas",
    "mocha",
    "fedavg",
    "lg-fedavg",
    "fedfomo",
    "fedproto",
    "local",
    "fedcp",
    "scaffold",
    "feddyn",
    "feddbe",
    "pflego",
    "d-fedem",
    "fedprox",
    "fednova",
    "fedem",
    "moon",
    "fedrecon",
    "fedlc",
    "pfedme",
    "perfedavg",
]

#: Step sizes 1 and 3 per decade, the ladder the grids are taken from.
LADDER = [float(f"{m}e{e}") for e in range(-5, 2) for m in (1, 3)]


def decimal(value: float) -> str:
    """``0.0003``, ``1.0``: a value as YAML reads back as the same float (never ``1e-05``)."""
    text = f"{value:.10f}".rstrip("0")
    return text + "0" if text.endswith(".") else text


def around(value: float, below: int, above: int) -> list[float]:
    """``value`` with the ``below`` ladder points under it and the ``above`` points over it (each
    at least 1.5 times away, so that 0.09's neighbours are 0.03 and 0.3, not 0.1)."""
    under = [x for x in LADDER if x < value / 1.5][-below:] if below else []
    over = [x for x in LADDER if x > value * 1.5][:above]
    return [*under, value, *over]


def current_default(algorithm: str) -> dict[str, Any]:
    """The algorithm's default step sizes as the registry has them now."""
    cls = ALGORITHMS[algorithm]
    point: dict[str, Any] = {"client_lr": float(cls.default_client_lr)}
    if algorithm in SECOND_STEP:
        name = SECOND_STEP[algorithm]
        point["options"] = {name: float(hyperparameters(cls)[name])}
    return point


def default_grid(algorithm: str) -> list[str]:
    """A log grid of ``client_lr`` around the default (two ladder points each side); for an
    algorithm with a second step size, a cross through the defaults: the ``client_lr`` points at
    the second's default, and the second's ladder neighbours at the ``client_lr`` default."""
    if algorithm in GRIDS:
        return GRIDS[algorithm]
    default = current_default(algorithm)
    lr = default["client_lr"]
    lrs = [x for x in around(lr, 2, 2) if x <= max(lr, 1.0)]  # SGD steps over 1 diverge
    if algorithm not in SECOND_STEP:
        return ["client_lr=" + ",".join(decimal(x) for x in lrs)]
    name = SECOND_STEP[algorithm]
    second = default["options"][name]
    pairs = [(x, second) for x in lrs] + [(lr, y) for y in around(second, 1, 1) if y != second]
    return [f"client_lr+options.{name}=" + ",".join(f"{decimal(a)}/{decimal(b)}" for a, b in pairs)]


def run_cell(
    algorithm: str, setting: str, grid: list[str], args: argparse.Namespace
) -> dict[str, Any]:
    """Tune one algorithm in one setting (resuming); every point's numbers and the CPU seconds."""
    values = {**COMMON, "rounds": args.rounds, "algorithm": algorithm}
    values |= {k: v for k, v in SETTINGS[setting].items() if k != "data"}
    if SETTINGS[setting].get("data"):
        values["data_dir"] = args.data_dir
    base = to_dict(load_config(values))
    tuning = Tuning(
        base,
        parse_grid(grid),
        [0],
        args.runs / f"{algorithm}-{setting}",
        title=f"Tuning {algorithm} in the setting {setting} (benchmarks/defaults_study.py)",
    )
    start = time.process_time()
    run_tuning(tuning, progress=False)
    spent = tuning.out / "cpu_seconds"  # accumulated over the sittings that trained this cell
    seconds = float(spent.read_text()) if spent.is_file() else 0.0
    seconds += time.process_time() - start
    spent.write_text(f"{seconds:.1f}\n")
    cell_results = args.results / f"{algorithm}-{setting}"
    cell_results.mkdir(parents=True, exist_ok=True)
    for name in ("tune.md", "chosen.yaml"):
        shutil.copy(tuning.out / name, cell_results / name)
    plan = tuning.plan()
    points = {}
    for score in score_points(tuning, plan):
        (run,) = plan.runs_of(ALL, score.name)
        history = History.load(tuning.runs_root / run.dir)
        loss = M.final_value(history, "train_loss", base["average_last"])
        points[point_label(score.values)] = {
            "val_acc": None if math.isnan(score.score) else score.score,
            "train_loss": None if math.isnan(loss) else loss,
            "status": "; ".join(s for s in score.status if s) or "ok",
        }
    return {"points": points, "cpu_seconds": round(seconds, 1)}


def regrets(points: dict[str, dict[str, Any]]) -> dict[str, float]:
    """Each point's relative regret against the setting's best point (1 for a diverged point)."""
    finite = [p["val_acc"] for p in points.values() if p["val_acc"] is not None]
    best = max(finite) if finite else math.nan
    return {
        label: 1.0 if p["val_acc"] is None else (best - p["val_acc"]) / best
        for label, p in points.items()
    }


def choose(table: dict[str, dict[str, float]], labels: list[str]) -> str:
    """Among ``labels``, the point with the smallest worst regret over the settings (then the
    smallest mean regret, then the first)."""

    def key(label: str) -> tuple[float, float]:
        values = [table[s][label] for s in table]
        return max(values), sum(values) / len(values)

    return min(labels, key=key)


def pct(value: float | None) -> str:
    return "diverged" if value is None else f"{100 * value:.2f}"


def summary_table(study: dict[str, Any]) -> list[str]:
    """One line per algorithm: its settings, the chosen point and the old default's regrets."""
    lines = [
        "## Summary",
        "",
        "| algorithm | settings | CPU s | chosen | worst regret | old default | worst regret |",
        "|---|---|---:|---|---:|---|---:|",
    ]
    for algorithm, entry in study["algorithms"].items():
        if "chosen" not in entry:
            continue
        done = [s for s, cell in entry["cells"].items() if cell.get("points")]
        cpu = sum(entry["cells"][s]["cpu_seconds"] for s in done)
        worst = entry["worst_regret"]
        lines.append(
            f"| {algorithm} | {', '.join(done)} | {cpu:.0f} | {entry['chosen']} | "
            f"{100 * worst['chosen']:.2f}% | {entry['old default']} | "
            f"{100 * worst['old default']:.2f}% |"
        )
    return [*lines, ""]


def render(study: dict[str, Any]) -> str:
    """``report.md``: per algorithm the grid, each setting's best, the choice and the old default."""
    lines = [
        "# Default step sizes chosen across settings",
        "",
        "Made by `benchmarks/defaults_study.py`. Each cell is a `pflego tune` grid on validation "
        f"data ({study['rounds']} rounds, seed 0, 10% of each client's training samples held out;"
        " the score is the mean validation accuracy over the last 10 rounds, each of which is "
        "evaluated: in the 10-round setting mnist-k2-100, every round); test data is never read. "
        "Per algorithm, the chosen point minimizes the "
        "worst relative regret over the settings, `(best - value) / best` with `best` the "
        "setting's best grid point; a diverged point's regret is 1 (100%).",
        "",
        "Settings (all 20% participation unless stated):",
        "",
    ]
    for name, values in study["settings"].items():
        lines.append(f"- `{name}`: " + ", ".join(f"{k}={v}" for k, v in values.items()))
    lines.append("")
    lines += summary_table(study)
    for algorithm, entry in study["algorithms"].items():
        settings = [s for s, cell in entry["cells"].items() if cell.get("points")]
        lines += [f"## {algorithm}", "", "Grid: " + "; ".join(f"`{g}`" for g in entry["grid"]), ""]
        lines += [
            f"- failed in {s}: {cell['error']}"
            for s, cell in entry["cells"].items()
            if "error" in cell
        ]
        if not settings:
            lines += [f"- old default: **{entry['old default']}**", ""]
            continue
        picks = {name: entry[name] for name in entry["worst_regret"]}
        lines += [
            f"- {name}: **{label}**, worst regret {100 * entry['worst_regret'][name]:.2f}%"
            for name, label in picks.items()
        ]
        lines += [
            f"- never chosen: **{label}**, diverged in a longer run: {why}"
            for label, why in entry.get("unstable", {}).items()
        ]
        lines += [
            "",
            "| setting | CPU s | best point | best val acc | "
            + " | ".join(f"{name}: val acc | regret" for name in picks)
            + " |",
            "|---|---:|---|---:|" + "---:|---:|" * len(picks),
        ]
        for s in settings:
            cell, reg = entry["cells"][s], entry["regret"][s]
            best = min(reg, key=reg.get)
            values = " | ".join(
                f"{pct(cell['points'][label]['val_acc'])} | {100 * reg[label]:.2f}%"
                if label in reg
                else "not in grid | 100.00%"
                for label in picks.values()
            )
            lines.append(
                f"| {s} | {cell['cpu_seconds']} | {best} | "
                f"{pct(cell['points'][best]['val_acc'])} | {values} |"
            )
        lines += ["", "Every point (validation accuracy %, per setting):", ""]
        lines += ["| point | " + " | ".join(settings) + " | worst regret |"]
        lines += ["|---|" + "---:|" * (len(settings) + 1)]
        for label in entry["regret"][settings[0]]:
            worst = max(entry["regret"][s][label] for s in settings)
            accs = " | ".join(pct(entry["cells"][s]["points"][label]["val_acc"]) for s in settings)
            lines.append(f"| {label} | {accs} | {100 * worst:.2f}% |")
        lines.append("")
    if study.get("findings"):
        lines += ["## Findings", "", *(f"- {x}" for x in study["findings"]), ""]
    if study.get("left_out"):
        lines += ["## Left out", "", *(f"- {x}" for x in study["left_out"]), ""]
    return "\n".join(lines)


def summarize(entry: dict[str, Any]) -> None:
    """Fill an algorithm's entry of study.json: each setting's regrets and the picks."""
    cells = {s: c for s, c in entry["cells"].items() if c.get("points")}
    table = {setting: regrets(cell["points"]) for setting, cell in cells.items()}
    entry["regret"] = table
    if not table:
        return
    unstable = entry.get("unstable", {})  # diverged in a run longer than the cells' rounds
    labels = [label for label in next(iter(table.values())) if label not in unstable]
    picks = {"chosen": choose(table, labels)}
    sgd = [label for label in labels if "server_optimizer=sgd" in label]
    if sgd:  # the library's default server optimizer is SGD for every method
        picks["chosen among SGD servers"] = choose(table, sgd)
    picks["old default"] = entry["old default"]
    entry.update(picks)
    entry["worst_regret"] = {
        name: max(table[s].get(label, 1.0) for s in table) for name, label in picks.items()
    }


def write(study: dict[str, Any], results: Path) -> None:
    """study.json and report.md, each replaced whole (a killed sitting leaves them readable)."""
    results.mkdir(parents=True, exist_ok=True)
    for name, text in (
        ("study.json", json.dumps(study, indent=1) + "\n"),
        ("report.md", render(study)),
    ):
        partial = results / f".{name}.partial"
        partial.write_text(text)
        partial.replace(results / name)


def algorithms_in_order() -> list[str]:
    """Every registered algorithm with a step size, in the leaderboard's order."""
    known = [name for name in LEADERBOARD if name in ALGORITHMS]
    rest = sorted(set(ALGORITHMS) - set(known))
    return [name for name in known + rest if name not in NO_STEP_SIZE]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--algorithms", default="all", help="comma-separated, or all (default)")
    parser.add_argument("--settings", default=",".join(CHEAP_SETTINGS))
    parser.add_argument(
        "--confirm",
        default=CONFIRM_SETTING,
        help="a setting run only for the algorithms whose choice differs from their default",
    )
    parser.add_argument("--rounds", type=int, default=COMMON["rounds"])
    parser.add_argument("--data-dir", default=None)
    parser.add_argument("--runs", type=Path, default=Path("runs/defaults"))
    parser.add_argument("--results", type=Path, default=Path("results/defaults"))
    parser.add_argument("--left-out", action="append", default=None, help="a line for the report")
    parser.add_argument("--finding", action="append", default=None, help="a line for the report")
    parser.add_argument(
        "--unstable",
        action="append",
        default=[],
        metavar="ALGORITHM|POINT|EVIDENCE",
        help="a grid point never to choose: it diverged in a longer run (the evidence: which)",
    )
    parser.add_argument(
        "--report-only",
        action="store_true",
        help="train nothing: rewrite report.md from study.json",
    )
    args = parser.parse_args()
    torch.set_num_threads(1)
    path = args.results / "study.json"
    study: dict[str, Any] = (
        json.loads(path.read_text())
        if path.is_file()
        else {"rounds": args.rounds, "settings": {}, "algorithms": {}}
    )
    if study["rounds"] != args.rounds:
        raise SystemExit(
            f"{path} holds {study['rounds']}-round cells; give --rounds {study['rounds']}"
        )
    study["left_out"] = args.left_out if args.left_out is not None else study.get("left_out", [])
    study["findings"] = args.finding if args.finding is not None else study.get("findings", [])
    for spec in args.unstable:
        algorithm, label, evidence = spec.split("|", 2)
        study["algorithms"][algorithm].setdefault("unstable", {})[label] = evidence
    names = algorithms_in_order() if args.algorithms == "all" else args.algorithms.split(",")
    settings = [] if args.report_only else args.settings.split(",")
    for algorithm in names:
        entry = study["algorithms"].get(algorithm)
        for setting in [*settings, *([args.confirm] if args.confirm and settings else [])]:
            if setting == args.confirm and (
                entry is None or entry.get("chosen", entry["old default"]) == entry["old default"]
            ):
                continue  # the default stays: no third setting needed to confirm a change
            if entry is not None and "points" in entry["cells"].get(setting, {}):
                continue  # finished in an earlier sitting (a failed cell is tried again)
            if entry is None:
                old = OLD_DEFAULTS.get(algorithm) or current_default(algorithm)
                entry = {
                    "grid": default_grid(algorithm),
                    "old default": point_label(old),
                    "cells": {},
                }
                study["algorithms"][algorithm] = entry
            study["settings"][setting] = {k: v for k, v in SETTINGS[setting].items() if k != "data"}
            try:
                cell = run_cell(algorithm, setting, entry["grid"], args)
            except Exception as error:  # noqa: BLE001 - one method's failure must not stop the rest
                cell = {"error": f"{type(error).__name__}: {str(error).splitlines()[0]}"}
            entry["cells"][setting] = cell
            summarize(entry)
            write(study, args.results)
            print(
                f"{algorithm} {setting}: {cell.get('cpu_seconds', cell.get('error'))}", flush=True
            )
    for entry in study["algorithms"].values():
        summarize(entry)
    write(study, args.results)
    print(f"wrote {args.results / 'report.md'}")


if __name__ == "__main__":
    main()
