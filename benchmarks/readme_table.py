"""Print the README's table of a committed experiment from its runs' ``metrics.jsonl``.

    python benchmarks/readme_table.py results/main                          # README.md
    python benchmarks/readme_table.py results/leaderboard-mnist-offline --ranked   # docs

The README shows these tables as printed here, to the last digit (tests/test_readme.py holds them
equal): the mean test accuracy of the window ``pflego report`` averages, its bottom decile and
sample-weighted mean (percent, two decimals), the training loss and one client's GFLOP per round.
The means are taken over the full-precision records of every run (``report.csv`` keeps six
significant digits, too few to round a mean like 92.755 as ``report.md`` does), each run's
window first and then the seeds. ``--ranked`` ranks the methods by test accuracy in two
side-by-side halves.
"""

from __future__ import annotations

import argparse
import csv
import json
import statistics
from pathlib import Path

METRICS = ("test_acc", "test_acc_p10", "test_acc_weighted", "train_loss")


def read_rows(experiment: Path) -> list[dict[str, float | str]]:
    """One row per algorithm, in ``report.csv``'s order: its name, :data:`METRICS` averaged
    over the report's window of rounds and over seeds, and one client's FLOPs per round."""
    with (experiment / "report.csv").open(newline="") as f:
        rows = list(csv.DictReader(f))
    runs = json.loads((experiment / "experiment.json").read_text())["runs"]
    out = []
    for row in rows:
        first, last = int(row["window_first_round"]), int(row["window_last_round"])
        seeds = [
            window_means(experiment / run["dir"] / "metrics.jsonl", first, last)
            for run in runs
            if run["row"] == row["row"]
        ]
        means = {key: statistics.fmean(seed[key] for seed in seeds) for key in METRICS}
        out.append(
            {
                **means,
                "algorithm": row["algorithm"],
                "first": first,
                "last": last,
                "client_flops": float(row["client_flops_per_round"]),
            }
        )
    return out


def window_means(metrics: Path, first: int, last: int) -> dict[str, float]:
    """:data:`METRICS` averaged over a run's evaluations of rounds ``first`` to ``last``."""
    records = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    window = [r for r in records if first <= r["round"] <= last]
    return {key: statistics.fmean(r[key] for r in window) for key in METRICS}


def percent(value: float) -> str:
    return f"{100 * value:.2f}"


def table(experiment: Path) -> str:
    """Accuracy, bottom decile, sample-weighted accuracy, training loss and client GFLOP."""
    rows = read_rows(experiment)
    first, last = rows[0]["first"], rows[0]["last"]
    lines = [
        f"| algorithm | test_acc (%), mean of rounds {first}–{last} | bottom decile (%) | "
        "sample-weighted (%) | training loss L(ψ) | client GFLOP per round |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for row in rows:
        cells = [
            row["algorithm"],
            percent(row["test_acc"]),
            percent(row["test_acc_p10"]),
            percent(row["test_acc_weighted"]),
            f"{row['train_loss']:.4f}",
            f"{row['client_flops'] / 1e9:.3g}",
        ]
        lines.append(f"| {' | '.join(cells)} |")
    return "\n".join(lines)


def ranked(experiment: Path) -> str:
    """Every method ranked by test accuracy (and its bottom decile), in two halves side by side."""
    rows = sorted(read_rows(experiment), key=lambda row: -row["test_acc"])
    cells = [
        f"{rank} | {row['algorithm']} | {percent(row['test_acc'])} | {percent(row['test_acc_p10'])}"
        for rank, row in enumerate(rows, 1)
    ]
    half = (len(cells) + 1) // 2
    lines = [
        "| rank | method | test acc. | bottom decile | rank | method | test acc. | bottom decile |",
        "|---:|---|---:|---:|---:|---|---:|---:|",
    ]
    for i in range(half):
        right = cells[half + i] if half + i < len(cells) else " | | | "
        lines.append(f"| {cells[i]} | {right} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("experiment", type=Path, help="a folder of results/ with report.csv")
    parser.add_argument("--ranked", action="store_true", help="the leaderboard's ranked layout")
    args = parser.parse_args()
    print(ranked(args.experiment) if args.ranked else table(args.experiment))


if __name__ == "__main__":
    main()
