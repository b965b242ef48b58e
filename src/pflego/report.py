"""Side-by-side comparisons of runs: a Markdown table and one figure."""

from __future__ import annotations

from datetime import datetime
from importlib import resources
from pathlib import Path
from typing import Any

import yaml

from pflego.config import load_config, read_yaml
from pflego.errors import ConfigError
from pflego.history import History
from pflego.plots import plot_histories

MAIN_EXPERIMENT = "main.yaml"


def preset(name: str = MAIN_EXPERIMENT) -> dict[str, Any]:
    """A comparison preset shipped with the package (``settings`` plus per-algorithm overrides)."""
    return yaml.safe_load(resources.files("pflego.configs").joinpath(name).read_text())


def comparison_spec(source: str | Path | None) -> dict[str, Any]:
    """Read a comparison file: ``{settings: {...}, algorithms: {name: {...}}}`` or a plain config."""
    spec = preset() if source is None else read_yaml(source)
    if "settings" not in spec and "algorithms" not in spec:
        spec = {"settings": spec, "algorithms": {}}
    if not isinstance(spec.get("algorithms") or {}, dict):
        raise ConfigError("'algorithms' in a comparison file must map algorithm names to settings")
    return {"settings": spec.get("settings") or {}, "algorithms": spec.get("algorithms") or {}}


def comparison_table(histories: dict[str, History], last: int) -> str:
    """Markdown table of final metrics (averaged over the last ``last`` rounds, as the papers do)."""
    header = (
        f"| algorithm | test acc (%), mean of last {max(last, 1)} rounds | sample-weighted (%) "
        "| bottom 10% of clients (%) | training loss L(ψ) | rounds | time (s) |"
    )
    lines = [header, "|---|---:|---:|---:|---:|---:|---:|"]
    for name, history in histories.items():
        m = history.final(last)
        lines.append(
            f"| {name} | {100 * m['test_acc']:.2f} | {100 * m['test_acc_weighted']:.2f} "
            f"| {100 * m['test_acc_p10']:.2f} | {m['train_loss']:.4f} "
            f"| {history.records[-1]['round']} | {m['seconds']:.1f} |"
        )
    return "\n".join(lines)


def compare(
    algorithms: list[str] | None = None,
    source: str | Path | None = None,
    out: str | Path | None = None,
    progress: bool = True,
    **overrides: Any,
) -> tuple[str, dict[str, History]]:
    """Run several algorithms on the same setting and write ``comparison.md`` and ``comparison.png``.

    Args:
        algorithms: Names to run; default the file's (or the main experiment's) algorithms.
        source: A comparison file; ``None`` for the main experiment.
        out: Directory for the runs (one sub-directory per algorithm) and the comparison.
        progress: Show progress bars.
        **overrides: Settings that replace the file's for every algorithm.

    Returns:
        The Markdown table and each algorithm's history.
    """
    from pflego.sim.runner import build_experiment, run_experiment

    spec = comparison_spec(source)
    names = algorithms or list(spec["algorithms"]) or ["pflego", "fedavg", "fedper"]
    configs = {
        name: load_config(
            {**spec["settings"], **spec["algorithms"].get(name, {}), **overrides}, algorithm=name
        )
        for name in names
    }  # validate every config before running any
    out = Path(out or Path("runs") / f"compare-{datetime.now().strftime('%Y%m%d-%H%M%S')}")
    histories = {
        name: run_experiment(build_experiment(cfg), out / name, progress)
        for name, cfg in configs.items()
    }
    last = next(iter(configs.values())).average_last
    table = comparison_table(histories, last)
    first = next(iter(configs.values()))
    title = f"{first.dataset}, {first.clients} clients, {first.partition} partition"
    (out / "comparison.md").write_text(f"# {title}\n\n{table}\n")
    plot_histories(histories, out / "comparison.png", title)
    return table, histories
