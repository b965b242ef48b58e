"""One command per experiment: ``reproduce`` a preset, ``compare`` algorithms, ``run`` several seeds.

Each builds a :class:`~pflego.experiments.runs.Plan`, checks every config and every dataset's
files before anything trains, runs what is not finished yet, and writes the report from the run
directories.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path
from typing import Any

from pflego.config import load_config, to_dict
from pflego.errors import ConfigError
from pflego.experiments.folders import check_out, clear_out, stamp
from pflego.experiments.parallel import RunsFailedError, Workers
from pflego.experiments.presets import (
    Preset,
    Row,
    grid_points,
    load_preset,
    one_row,
    point_label,
)
from pflego.experiments.report import Report, write_report
from pflego.experiments.runs import Plan, build_plan, check_data, execute, read_manifest
from pflego.experiments.tune import Tuning, run_tuning
from pflego.history import History

MAIN_PRESET = "main"


def default_reproduce_out(name: str, quick: bool, offline: bool, tune: bool) -> Path:
    """``runs/<preset>[-quick][-offline][-tuned]``: fixed, so rerunning a command resumes it."""
    suffix = "".join(
        s for s, on in (("-quick", quick), ("-offline", offline), ("-tuned", tune)) if on
    )
    return Path("runs") / f"{Path(name).stem}{suffix}"


def reproduce(
    name: str | Path,
    seeds: list[int] | None = None,
    rounds: int | None = None,
    quick: bool = False,
    offline: bool = False,
    data_dir: str | Path | None = None,
    out: str | Path | None = None,
    tune: bool = False,
    tune_seeds: list[int] | None = None,
    tune_rounds: int | None = None,
    target_acc: float | None = None,
    overrides: dict[str, Any] | None = None,
    blocks: list[str] | None = None,
    rows: list[str] | None = None,
    progress: bool = True,
    workers: Workers | None = None,
    overwrite: bool = False,
) -> Report:
    """Run a preset's experiment (or finish an interrupted one) and write its report.

    Args:
        name: A shipped preset's name or a preset file.
        seeds: Seeds per row (default: the preset's own seed, once).
        rounds: Replace every run's number of rounds.
        quick: The preset's small version (smoke tests, CI).
        offline: The preset's offline form: its stand-in data (stated in the report).
        data_dir: Folder with the datasets' files.
        out: Output directory (default ``runs/<name>[-quick][-offline][-tuned]``; rerunning into
            it finishes what is missing and repeats nothing).
        tune: Tune the rows the preset gives a ``tune`` grid, on validation data, first.
        tune_seeds: Seeds of the tuning runs (default ``[0]``).
        tune_rounds: Rounds of every tuning run (default: the runs' own); the same for every
            grid point, so every method keeps the same budget.
        target_acc: Accuracy (fraction) whose first round the report gives.
        overrides: Further settings for every run (``--set``).
        blocks: Only these blocks (default all).
        rows: Only these rows (default all).
        progress: Progress bars and a line per run.
        workers: Run the runs in parallel processes (``--jobs``, ``--devices``).
        overwrite: Replace whatever pflego wrote in ``out`` (by default a folder that holds
            anything but this preset's reproduction is refused).

    Returns:
        The report (also written as ``report.md``, ``report.csv``, ``report.png``).
    """
    preset = load_preset(name).restricted(blocks, rows)
    if offline and not preset.offline:
        raise ConfigError(f"preset {preset.name} has no offline form; run it on its own data")
    extra = dict(overrides or {})
    if rounds is not None:
        extra["rounds"] = rounds
    if data_dir is not None:
        extra["data_dir"] = str(data_dir)
    root = Path(out) if out else default_reproduce_out(preset.name, quick, offline, tune)
    check_out(root, "reproduction", overwrite, continues=True, name=preset.name)
    preset, skipped = blocks_with_data(preset, extra, quick, offline, blocks)
    plan = build_plan(preset, "reproduce", seeds, quick, offline, extra)  # checks every config
    tunings = (
        tuning_jobs(preset, root, quick, offline, extra, tune_seeds, tune_rounds) if tune else []
    )
    for _, _, job in tunings:
        check_data(job.plan())  # every grid point and its validation split, before training
    check_data(plan)
    if overwrite:
        clear_out(root)
    tuned: dict[str, dict[str, Any]] = {}
    for block, row, job in tunings:
        choice = run_tuning(job, progress, workers)
        choice.pop("settings")
        choice["report"] = str((job.out / "tune.md").relative_to(root))
        tuned.setdefault(block, {})[row] = choice
    if tune:
        plan = build_plan(preset, "reproduce", seeds, quick, offline, extra, tuned)
        budgets = ", ".join(f"{row} {len(grid_points(grid))}" for row, grid in preset.tune.items())
        job = tunings[0][2]
        plan.notes.append(
            f"Tuned rows: chosen on validation data by `--tune` (see 'Tuned settings'); grid "
            f"points per row: {budgets}; every point run for {job.plan().runs[0].config['rounds']} "
            f"rounds on tuning seeds {', '.join(map(str, job.seeds))}."
        )
    plan.notes += skipped
    forms = [
        f for f, on in (("quick form", quick and preset.quick), ("offline form", offline)) if on
    ]
    relabel(plan, preset, extra, forms)
    plan.target_acc = target_acc if target_acc is not None else preset.target_acc
    return execute_and_report(plan, root, progress, workers)


def blocks_with_data(
    preset: Preset,
    overrides: dict[str, Any],
    quick: bool,
    offline: bool,
    asked: list[str] | None,
) -> tuple[Preset, list[str]]:
    """The preset without the blocks whose ``data`` is missing, and a note for each skipped one.

    A block asked for by name (``--blocks``) is never skipped: its missing files are an error.
    """
    from pflego.data import DATASETS, load_dataset
    from pflego.errors import DataError

    keep, notes = [], []
    for block in preset.blocks:
        needed = [d for d in preset.block_data.get(block, ()) if DATASETS[d].needs_data_dir]
        if offline or not needed or block in (asked or []):
            keep.append(block)
            continue
        first = next(iter(preset.rows))
        data_dir = preset.run_settings(block, first, None, quick, offline, None, overrides).get(
            "data_dir"
        )
        try:
            for dataset in needed:
                load_dataset(dataset, data_dir)
        except DataError as exc:
            notes.append(f"Block {block} skipped: its data is missing ({exc}).")
            print(f"pflego: {notes[-1]}", file=sys.stderr)
            continue
        keep.append(block)
    if not keep:
        raise DataError(f"every block of {preset.name} lacks its data; {notes[0]}")
    return preset.restricted(blocks=keep), notes


def tuning_jobs(
    preset: Preset,
    root: Path,
    quick: bool,
    offline: bool,
    overrides: dict[str, Any],
    seeds: list[int] | None,
    rounds: int | None = None,
) -> list[tuple[str, str, Tuning]]:
    """One tuning job per block and per row with a ``tune`` grid."""
    if not preset.tune:
        raise ConfigError(f"preset {preset.name} has no tune grids; run it without --tune")
    jobs = []
    for block in preset.blocks:
        for row, grid in preset.tune.items():
            where = root / "tune" / (f"{block}/{row}" if preset.has_blocks else row)
            base = preset.run_settings(block, row, None, quick, offline, None, overrides)
            if rounds is not None:
                base["rounds"] = rounds
            title = f"Tuning {row} of {preset.name}" + (
                f", block {block}" if preset.has_blocks else ""
            )
            job = Tuning(base, grid, seeds or [0], where, preset.rows[row].metric, title)
            jobs.append((block, row, job))
    return jobs


def relabel(plan: Plan, preset: Preset, changed: dict[str, Any], forms: list[str]) -> None:
    """Name the plan after its preset only when the preset ran unchanged: else its name and
    description say what ran (``main, quick form, rounds=3``) and what was changed."""
    shown = {k: v for k, v in changed.items() if k != "data_dir"}
    if not shown and not forms:
        return
    what = forms + ([f"set {point_label(shown)}"] if shown else [])
    plan.name = f"{preset.name}, {', '.join(what)}"
    plan.description = "not the preset as published: " + "; ".join(what)


def comparison_label(plan: Plan, source: str, changed: dict[str, Any]) -> None:
    """A comparison that is not its file's as written is named by what ran: ``compare:
    fedavg, pflego on mnist, 20 clients, 3 rounds``, described by what was changed."""
    config = plan.runs[0].config
    rows = ", ".join(row["name"] for row in plan.rows)
    plan.name = (
        f"compare: {rows} on {config['dataset']}, {config['clients']} clients, "
        f"{config['rounds']} rounds"
    )
    shown = {k: v for k, v in changed.items() if k != "data_dir"}
    plan.description = f"{source}'s settings" + (f" with {point_label(shown)}" if shown else "")


#: The settings a comparison file's rows tune for its dataset alone.
STEP_SIZES = ("client_lr", "server_lr")


def on_dataset(preset: Preset, dataset: str | None) -> tuple[Preset, list[str]]:
    """The preset on another ``dataset`` than the one it names: its rows' step sizes were chosen
    for its own, so each algorithm runs with its library defaults (as ``pflego run`` does), and a
    note says so."""
    if preset.settings.get("dataset") in (None, dataset):
        return preset, []
    rows = {
        name: dataclasses.replace(
            row, settings={k: v for k, v in row.settings.items() if k not in STEP_SIZES}
        )
        for name, row in preset.rows.items()
    }
    if rows == preset.rows:
        return preset, []
    note = (
        f"Step sizes: {preset.name}'s were chosen on {preset.settings.get('dataset')}; on "
        f"{dataset} every algorithm runs with its own defaults (`pflego list`) unless "
        "--client-lr / --server-lr set them."
    )
    return dataclasses.replace(preset, rows=rows), [note]


def comparison_preset(preset: Preset, algorithms: list[str] | None) -> Preset:
    """A comparison file's preset, restricted or extended to ``algorithms``."""
    if algorithms is None:
        return preset
    if not algorithms:
        raise ConfigError("--algorithms is empty; name at least one algorithm (see `pflego list`)")
    rows = {n: preset.rows.get(n) or Row(n, n, {}, preset.metric) for n in algorithms}
    return dataclasses.replace(preset, rows=rows)


def compare(
    algorithms: list[str] | None = None,
    source: str | Path | None = None,
    out: str | Path | None = None,
    progress: bool = True,
    workers: Workers | None = None,
    seeds: list[int] | None = None,
    resume: str | Path | None = None,
    target_acc: float | None = None,
    overwrite: bool = False,
    **overrides: Any,
) -> tuple[str, dict[str, History]]:
    """Run several algorithms on one setting; write ``comparison.md``, ``.csv`` and ``.png``.

    Every algorithm name, option and setting is checked, and every dataset loaded, before the
    first run trains.

    Args:
        algorithms: Row names to run (default the file's rows; a name the file lacks runs that
            algorithm with the file's settings).
        source: A comparison file (``settings`` + ``algorithms``, or a plain config); default the
            main experiment (``configs/main.yaml``).
        out: Output directory (default ``runs/compare-<time>``); a row's runs go to ``<row>/``
            (``<row>/seed-<s>/`` with ``seeds``).
        progress: Progress bars.
        workers: Run the runs in parallel processes (``--jobs``, ``--devices``).
        seeds: Run every row with each of these seeds.
        resume: Finish the interrupted comparison in this directory instead (nothing finished is
            run again).
        target_acc: Accuracy (fraction) whose first round the table gives.
        overwrite: Replace whatever pflego wrote in ``out`` (by default a folder that holds
            anything of pflego's is refused).
        **overrides: Settings for every row.

    Returns:
        The main table (Markdown) and each row's first run's history.
    """
    if resume is not None:
        root = Path(resume)
        plan = read_manifest(root)
    else:
        written = load_preset(source if source is not None else MAIN_PRESET)
        preset, notes = on_dataset(comparison_preset(written, algorithms), overrides.get("dataset"))
        plan = build_plan(preset, "compare", seeds, overrides=overrides, seed_dirs=False)
        plan.notes += notes
        if list(preset.rows) != list(written.rows) or set(overrides) - {"data_dir"}:
            comparison_label(plan, preset.name, overrides)
        plan.target_acc = target_acc
        root = Path(out) if out else Path("runs") / f"compare-{stamp()}"
        check_out(root, "comparison", overwrite)
    check_data(plan)
    if overwrite and resume is None:
        clear_out(root)
    report = execute_and_report(plan, root, progress, workers, target_acc, "comparison")
    histories = {}
    for spec in plan.rows:
        first = plan.runs_of(next(iter(plan.blocks)), spec["name"], plan.sweep_values()[0])[0]
        histories[spec["name"]] = History.load(root / first.dir)
    return report.summary(), histories


def run_seeds(
    config: Any,
    seeds: list[int],
    out: str | Path | None = None,
    progress: bool = True,
    workers: Workers | None = None,
    overwrite: bool = False,
    **overrides: Any,
) -> Report:
    """One setting with several seeds: ``<out>/seed-<s>/`` and a report over them (``overwrite``:
    replace whatever pflego wrote in ``out``, else refused)."""
    settings = to_dict(load_config(config, **overrides))
    algorithm = settings["algorithm"]
    preset = one_row(f"{algorithm} on {settings['dataset']}", settings)
    plan = build_plan(preset, "seeds", seeds, row_dirs=False)
    root = Path(out) if out else Path("runs") / f"{algorithm}-{settings['dataset']}-seeds-{stamp()}"
    check_out(root, "run over seeds", overwrite)
    check_data(plan)
    if overwrite:
        clear_out(root)
    return execute_and_report(plan, root, progress, workers)


def execute_and_report(
    plan: Plan,
    root: Path,
    progress: bool,
    workers: Workers | None,
    target_acc: float | None = None,
    stem: str = "report",
) -> Report:
    """Run the plan's unfinished runs and write its report, also when some runs failed (the
    report marks them; :class:`RunsFailedError` follows)."""
    try:
        execute(plan, root, progress, workers)
    except RunsFailedError:
        write_report(root, target_acc=target_acc, stem=stem)
        raise
    return write_report(root, target_acc=target_acc, stem=stem)
