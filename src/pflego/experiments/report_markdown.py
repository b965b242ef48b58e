"""``report.md``: the settings, what every number means, each block's tables and the paper.

Beside the tables of :mod:`~pflego.experiments.report_tables`: the settings line (those equal in
every row) and each row's own settings, the paragraph that defines every measure, the tuned
settings, the other quantities the paper reports, and the paper's per-group numbers beside ours.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from pflego.experiments import measures as M
from pflego.experiments.presets import ALL, point_label
from pflego.experiments.report_rows import RowResult, logged, rows_by_block
from pflego.experiments.report_tables import (
    block_title,
    fmt,
    main_table,
    md_table,
    measures_table,
    paper_text,
    ranking_table,
    seed_table,
    several_seeds,
    unit,
    window_text,
    windows,
)
from pflego.experiments.runs import Plan

#: Settings that describe an experiment in a report's settings line (when equal for all runs).
DESCRIBING = (
    "dataset",
    "model",
    "partition",
    "classes_per_client",
    "alpha",
    "clients",
    "participation",
    "sampling",
    "rounds",
    "inner_steps",
    "local_epochs",
    "batch_size",
    "client_lr",
    "server_lr",
    "client_optimizer",
    "server_optimizer",
    "val_fraction",
    "unseen_fraction",
    "eval_every",
    "average_last",
)


def describing(config: dict[str, Any]) -> dict[str, Any]:
    """The settings that describe a run (partition parameters only where they apply)."""
    out = {k: config.get(k) for k in DESCRIBING}
    if config.get("partition") not in ("classes", "auto"):
        out.pop("classes_per_client")
    if config.get("partition") not in ("dirichlet", "pachinko"):
        out.pop("alpha")
    out |= {f"options.{k}": v for k, v in (config.get("options") or {}).items()}
    return out


def common_settings(rows: list[RowResult]) -> dict[str, Any]:
    """The describing settings (set, not default) equal in every row."""
    described = [describing(r.settings) for r in rows]
    if not described:
        return {}
    return {
        k: v
        for k, v in described[0].items()
        if v is not None and all(k in d and d[k] == v for d in described)
    }


def row_differences(row: RowResult, rows: list[RowResult]) -> str:
    """The describing settings in which ``row`` differs from another row of ``rows``."""
    described = [describing(r.settings) for r in rows]
    own = describing(row.settings)
    keys = [k for k in own if any(d.get(k) != own[k] for d in described)]
    return ", ".join(f"{k}={'default' if own[k] is None else own[k]}" for k in keys) or "—"


def metric_definition(metric: str) -> str:
    """What a metrics.jsonl accuracy key measures, in one sentence (see ``eval.summarize``)."""
    where = ""
    base = metric
    if base.startswith("unseen_"):
        base, where = base[len("unseen_") :], " of the clients that never trained (after `join`)"
    split, _, rest = base.partition("_")
    if not rest.startswith("acc"):
        return f"`{metric}` as logged in metrics.jsonl{where}"
    split_name = {"test": "test", "val": "validation", "train": "training"}.get(split, split)
    parts = [p for p in rest[len("acc") :].split("_") if p]
    statistic = "averaged over clients with equal weight"
    if parts[:1] == ["weighted"]:
        statistic, parts = (
            f"averaged over clients weighted by their {split_name} samples",
            parts[1:],
        )
    elif parts[:1] in (["p10"], ["p90"]):
        decile = "bottom" if parts[0] == "p10" else "top"
        statistic = f"the {parts[0][1:]}th percentile over clients ({decile} decile)"
        parts = parts[1:]
    elif parts[:1] == ["std"]:
        statistic, parts = "its standard deviation over clients", parts[1:]
    view = "_".join(parts)
    model = "each client's personalized model (after `adapt` where the algorithm has one)"
    if view == "before_adapt":
        model = "each client's model before `adapt`"
    elif view:
        model = f"the algorithm's `{view}` prediction"
    return f"`{metric}`: accuracy of {model} on its own {split_name} split, {statistic}{where}"


def render_markdown(plan: Plan, rows: list[RowResult], target_acc: float | None) -> str:
    """``report.md``."""
    lines = [f"# {plan.name}" + (f": {plan.description}" if plan.description else ""), ""]
    if plan.paper:
        lines.append(
            f"Paper: {plan.paper}." + (f" Paper's numbers: {plan.source}." if plan.source else "")
        )
    common = common_settings(rows)
    if common:
        lines.append("Settings: " + point_label(common) + ".")
    seeds = sorted({s.seed for r in rows for s in r.seeds})
    lines.append(f"Seeds: {', '.join(map(str, seeds))}.")
    lines.append("")
    for note in plan.notes:
        lines.append(f"- {note}")
    if plan.notes:
        lines.append("")
    lines += definitions(plan, rows, target_acc)
    has_paper = bool(plan.paper_results)
    for block, block_rows in rows_by_block(plan, rows).items():
        if list(plan.blocks) != [ALL]:
            lines += [f"## {block_title(plan, block)}", ""]
        if plan.ranked:
            lines += md_table(*ranking_table(block_rows), align="r") + [""]
        lines += md_table(*main_table(block_rows, has_paper), align="r") + [""]
        more = measures_table(block_rows, target_acc)
        if more:
            lines += md_table(*more, align="r") + [""]
        per_row = [[r.label, row_differences(r, block_rows)] for r in block_rows]
        if any(cell[1] != "—" for cell in per_row):
            lines += md_table(["algorithm", "its own settings"], per_row) + [""]
        metric_names = sorted({r.metric for r in block_rows})
        lines += [f"Per seed ({', '.join(f'{m}{unit(m)}' for m in metric_names)}):", ""]
        lines += md_table(*seed_table(block_rows), align="r") + [""]
    lines += tuned_section(plan) + extra_paper_section(plan, rows) + group_section(plan, rows)
    if plan.kind != "runs":
        lines.append(
            "Every run directory is kept under this folder (listed in experiment.json); "
            "`pflego report <this folder>` rebuilds this report."
        )
    return "\n".join(lines).rstrip() + "\n"


def spread_text(rows: list[RowResult]) -> str:
    """What the top decile, the std over clients and the participation gap are, where shown."""
    text = ""
    if logged(rows, "p90"):
        text += (
            " Top decile: the 90th percentile of the clients' accuracies; std over clients: their"
            " standard deviation (population, over the clients with test data)."
        )
    if logged(rows, "gap"):
        text += (
            " Participation gap (Yuan et al., ICLR 2022): the mean accuracy of the clients that"
            " never trained (after `join`) minus that of the clients that trained."
        )
    return text


def definitions(plan: Plan, rows: list[RowResult], target_acc: float | None) -> list[str]:
    """The paragraph that says what every number is."""
    several = several_seeds(rows)
    parts = [metric_definition(m) for m in sorted({r.metric for r in rows})]
    spans = windows(rows)
    if len(spans) == 1:
        final = window_text(spans.pop())
    else:
        final = "mean of the evaluations in each run's last `average_last` rounds (the per-seed table names runs that stopped early)"
    text = (
        "**What is measured.** "
        + "; ".join(parts)
        + f". The final value is the {final}; round 0 (the untrained model) is never included. "
        + ("± is the sample standard deviation over seeds. " if several else "")
        + "Bottom decile: the 10th percentile of "
        "the clients' accuracies; sample-weighted: clients weighted by their test samples; "
        "training loss L(ψ) = Σ_i α_i ℓ_i over all training clients; training time excludes "
        "evaluation. Accuracies in percent (metrics.jsonl and report.csv store fractions under "
        "the same names); differences in percentage points (pp)."
    )
    text += spread_text(rows)
    if any(s.best_val for r in rows for s in r.seeds):
        text += (
            ' "At the best-validation round": the test value at the evaluation with the highest '
            f"validation accuracy ({'mean over seeds; ' if several else ''}the rounds chosen are "
            "listed), never the best test round."
        )
    if target_acc is not None:
        text += (
            f' "Rounds to {100 * target_acc:g}%": the first evaluated round whose value reaches '
            "it (evaluations every `eval_every` rounds)"
            + (", mean over the seeds that reach it." if several else ".")
        )
    if any(s.gain for r in rows for s in r.seeds):
        text += (
            ' "Gain over local": each client\'s final value minus its final value in the `local` '
            "row's run of the same partition and seed; mean and standard deviation over clients"
            + (" (averaged over seeds)." if several else ".")
        )
    if any(s.costs for r in rows for s in r.seeds):
        text += (
            " Communication and FLOPs are measured once, on round 0: parameter tensors of the "
            "downlink and of the uploads (MB = 10^6 bytes) times the expected cohort size, and "
            "the FLOPs one participating client spends on its update (torch.utils.flop_counter)."
        )
    return [text, ""]


def tuned_section(plan: Plan) -> list[str]:
    if not plan.tuned:
        return []
    lines = ["## Tuned settings", ""]
    cells = []
    for block, by_row in plan.tuned.items():
        for row, choice in by_row.items():
            cells.append(
                [
                    block,
                    row,
                    point_label(choice["values"]),
                    f"{fmt(choice['score'], choice['metric'])} ({choice['metric']})",
                    str(choice["points"]),
                    choice["report"],
                ]
            )
    lines += md_table(
        ["block", "row", "chosen", "validation score (%)", "grid points", "every point"], cells
    )
    edges = [
        f"- {block} / {row}: {note}."
        for block, by_row in plan.tuned.items()
        for row, choice in by_row.items()
        for note in choice.get("edges", [])
    ]
    return lines + [""] + (["At the edge of a grid:", "", *edges, ""] if edges else [])


def ours_quantity(row: RowResult, quantity: str) -> float:
    """Our value of a quantity the paper reports beside the main metric."""
    values = []
    for s in row.seeds:
        if s.history is None or not s.last_round:
            continue
        if quantity == "seconds_per_round":
            values.append(s.seconds / s.last_round)
        elif quantity == "rounds_to_target":
            values.append(math.nan if s.to_target is None else s.to_target)
        elif quantity == "gain_over_local":
            values.append(math.nan if s.gain is None else s.gain[0])
        else:
            values.append(M.final_value(s.history, quantity, row.settings["average_last"]))
    return float(np.mean(values)) if values else math.nan


def extra_paper_section(plan: Plan, rows: list[RowResult]) -> list[str]:
    cells = []
    for row in rows:
        for quantity, paper in plan.paper_results.get(row.block, {}).get(row.name, {}).items():
            if quantity == row.metric:
                continue
            ours = ours_quantity(row, quantity)
            scale = 100 if M.is_accuracy(quantity) or quantity == "gain_over_local" else 1
            cells.append([row.block, row.marked, quantity, f"{paper:g}", f"{scale * ours:.3g}"])
    if not cells:
        return []
    lines = ["## Other quantities the paper reports", ""]
    lines += md_table(["block", "algorithm", "quantity", "paper", "ours"], cells)
    return lines + [""]


def group_section(plan: Plan, rows: list[RowResult]) -> list[str]:
    """The paper's per-group numbers (natural groups, e.g. Office-Home's domains) beside ours."""
    if not plan.paper_groups:
        return []
    groups = list(plan.paper_groups)
    header = ["algorithm"] + [f"{g}: paper / ours (%)" for g in groups]
    cells = []
    for row in rows:
        ours: dict[str, list[float]] = {}
        for s in row.seeds:
            if s.history is not None and s.window:
                values = M.group_values(s.path, row.metric, row.settings["average_last"])
                for group, value in values.items():
                    ours.setdefault(group, []).append(value)
        line = [row.marked]
        for group in groups:
            paper = plan.paper_groups[group].get(row.name, {}).get(row.metric)
            mine = float(np.mean(ours[group])) if group in ours else math.nan
            line.append(f"{paper_text(paper)} / {fmt(mine, row.metric)}")
        cells.append(line)
    lines = [
        "## Per natural group",
        "",
        "Ours: the mean over each group's clients"
        + (", averaged over seeds." if several_seeds(rows) else "."),
        "",
    ]
    return lines + md_table(header, cells) + [""]
