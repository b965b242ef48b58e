"""Paper experiments as YAML presets: the format, its checks, and the settings of each run.

A preset (``src/pflego/configs/<name>.yaml``) names a setting, the rows of a table (one algorithm
configuration each), optional blocks (groups of rows with their own overrides, e.g. degrees of
personalization), the paper's numbers with their source, tuning grids and a sweep. The format is
described in ``docs/experiments.md``; every key is checked here, before any data is loaded.

The settings of one run are layered, later layers winning::

    settings <- block <- row <- the block's row overrides <- tuned values <- quick <- offline
             <- sweep value <- command line
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Iterable
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

import yaml

from pflego.config import FIELDS, read_yaml
from pflego.errors import ConfigError
from pflego.fields import between, check_value

PRESET_KEYS = (
    "description",
    "paper",
    "source",
    "data",
    "settings",
    "quick",
    "offline",
    "blocks",
    "algorithms",
    "metric",
    "paper_results",
    "tune",
    "sweep",
    "paper_std",
    "paper_results_by_group",
    "target_acc",
    "paper_rounds_to_target",
    "paper_gain_over_local",
    "ranked",
)
#: Keys a block may hold beside settings: the datasets it needs (a block whose data is missing is
#: skipped unless asked for by name) and row overrides that apply in that block only.
BLOCK_KEYS = ("data", "algorithms")
ROW_KEYS = ("algorithm", "same_run_as", "metric")
#: The block name of a preset without blocks (also the key of its ``paper_results``).
ALL = "all"
DEFAULT_METRIC = "test_acc"
DEFAULT_ALGORITHMS = ("pflego", "fedavg", "fedper")
#: The rule of a target accuracy (a preset's ``target_acc``, ``--target-acc``).
TARGET_ACC = between(0, 1, "(]").noting(" (an accuracy as a fraction, e.g. 0.7)")


@dataclass(frozen=True)
class Row:
    """One row of a preset's table.

    Attributes:
        name: The row's name (its key under ``algorithms``).
        algorithm: The registered algorithm it runs.
        settings: Its config overrides (``options`` nested), without the row-only keys.
        metric: The metrics.jsonl key the row reports.
        same_run_as: Another row whose runs this row reads (another metric of the same run).
    """

    name: str
    algorithm: str
    settings: dict[str, Any]
    metric: str
    same_run_as: str | None = None

    @property
    def runs_as(self) -> str:
        """The row whose runs this row reads (itself unless ``same_run_as``)."""
        return self.same_run_as or self.name


@dataclass(frozen=True)
class Preset:
    """A checked preset. See the module docstring and ``docs/experiments.md``."""

    name: str
    description: str = ""
    paper: str = ""
    source: str = ""
    data: tuple[str, ...] = ()
    settings: dict[str, Any] = field(default_factory=dict)
    quick: dict[str, Any] = field(default_factory=dict)
    offline: dict[str, Any] = field(default_factory=dict)
    blocks: dict[str, dict[str, Any]] = field(default_factory=lambda: {ALL: {}})
    block_data: dict[str, tuple[str, ...]] = field(default_factory=dict)
    block_rows: dict[str, dict[str, dict[str, Any]]] = field(default_factory=dict)
    rows: dict[str, Row] = field(default_factory=dict)
    metric: str = DEFAULT_METRIC
    paper_results: dict[str, dict[str, dict[str, float]]] = field(default_factory=dict)
    paper_std: dict[str, dict[str, dict[str, float]]] = field(default_factory=dict)
    paper_groups: dict[str, dict[str, dict[str, float]]] = field(default_factory=dict)
    tune: dict[str, list[tuple[str, list[Any]]]] = field(default_factory=dict)
    sweep: tuple[str, list[Any]] | None = None
    target_acc: float | None = None
    ranked: bool = False

    @property
    def has_blocks(self) -> bool:
        return list(self.blocks) != [ALL]

    def restricted(self, blocks: list[str] | None = None, rows: list[str] | None = None) -> Preset:
        """The preset with only some blocks and rows (in the preset's order)."""
        for kind, names, known in (("block", blocks, self.blocks), ("row", rows, self.rows)):
            for name in names or []:
                if name not in known:
                    raise ConfigError(
                        f"{self.name} has no {kind} {name!r}; its {kind}s: {', '.join(known)}"
                    )
        keep = [r for r in self.rows if rows is None or r in rows]
        for name in keep:
            source = self.rows[name].runs_as
            if source not in keep:
                raise ConfigError(f"row {name!r} reads the runs of row {source!r}; select both")
        return dataclasses.replace(
            self,
            blocks={b: v for b, v in self.blocks.items() if blocks is None or b in blocks},
            rows={r: self.rows[r] for r in keep},
            tune={r: g for r, g in self.tune.items() if r in keep},
        )

    def run_settings(
        self,
        block: str,
        row: str,
        tuned: dict[str, Any] | None = None,
        quick: bool = False,
        offline: bool = False,
        sweep_value: Any = None,
        overrides: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        """The settings of one run of ``row`` in ``block`` (see the module docstring's layers)."""
        spec = self.rows[self.rows[row].runs_as]
        layers = [
            self.settings,
            self.blocks[block],
            {**spec.settings, "algorithm": spec.algorithm},
            self.block_rows.get(block, {}).get(spec.name, {}),
            tuned or {},
            self.quick if quick else {},
            self.offline if offline else {},
            assignment(self.sweep[0], sweep_value)
            if self.sweep and sweep_value is not None
            else {},
            overrides or {},
        ]
        return merge(*layers)


def one_row(name: str, settings: dict[str, Any]) -> Preset:
    """A preset of one row, ``settings``' algorithm with nothing of its own."""
    algorithm = settings["algorithm"]
    rows = {algorithm: Row(algorithm, algorithm, {}, DEFAULT_METRIC)}
    return Preset(name=name, settings=settings, rows=rows)


def merge(*layers: dict[str, Any]) -> dict[str, Any]:
    """Settings layers merged left to right; ``options`` mappings merge key by key."""
    out: dict[str, Any] = {}
    for layer in layers:
        for key, value in layer.items():
            if key == "options" and isinstance(value, dict):
                out["options"] = {**out.get("options", {}), **value}
            else:
                out[key] = value
    return out


def assignment(key: str, value: Any) -> dict[str, Any]:
    """``{key: value}`` as settings, with ``options.K`` nested and a joint value's keys spread."""
    if key == "options" and isinstance(value, dict):  # a joint value's options stay options
        return {"options": dict(value)}
    if isinstance(value, dict):
        return merge(*(assignment(k, v) for k, v in value.items()))
    if key.startswith("options."):
        return {"options": {key[len("options.") :]: value}}
    return {key: value}


def check_key(key: str, where: str) -> None:
    """Fail unless ``key`` is a config setting or ``options.NAME``."""
    if key.startswith("options.") and len(key) > len("options."):
        return
    if key not in FIELDS or key in ("algorithm", "out"):
        raise ConfigError(f"{where}: {key!r} is not a setting; use a config key or options.NAME")


def check_settings(values: Any, where: str) -> dict[str, Any]:
    """A mapping of config settings (values are checked later, with the whole config)."""
    if values is None:
        return {}
    if not isinstance(values, dict):
        raise ConfigError(f"{where} must be a mapping of settings")
    for key in values:
        if key != "algorithm":
            check_key(str(key), where)
    return dict(values)


def grid_points(grid: list[tuple[str, list[Any]]]) -> list[dict[str, Any]]:
    """Every combination of a grid's dimensions, as settings (the first dimension varies slowest).

    A dimension is ``(key, values)``: a setting with scalar values, or any name with mappings of
    settings as values (a joint dimension, e.g. an optimizer with its own step size).
    """
    names = [name for name, _ in grid]
    return [
        merge(*(assignment(n, v) for n, v in zip(names, combo)))
        for combo in itertools.product(*(values for _, values in grid))
    ]


def flatten(settings: dict[str, Any]) -> dict[str, Any]:
    """Settings with ``options`` spelled ``options.NAME``."""
    flat = {k: v for k, v in settings.items() if k != "options"}
    return flat | {f"options.{k}": v for k, v in (settings.get("options") or {}).items()}


def point_label(point: dict[str, Any]) -> str:
    """``client_lr=0.1, options.mu=0.01`` for a grid point or a sweep value."""
    return ", ".join(f"{k}={v}" for k, v in flatten(point).items())


def _grid(values: Any, where: str) -> list[tuple[str, list[Any]]]:
    if not isinstance(values, dict) or not values:
        raise ConfigError(f"{where} must map settings to lists of values")
    grid = []
    for key, options in values.items():
        key = str(key)
        if not isinstance(options, list) or not options:
            raise ConfigError(f"{where}.{key} must be a non-empty list of values")
        if all(isinstance(v, dict) for v in options):
            for v in options:
                check_settings(v, f"{where}.{key}")
        elif any(isinstance(v, dict) for v in options):
            raise ConfigError(f"{where}.{key} mixes mappings and single values")
        else:
            check_key(key, where)
        grid.append((key, options))
    return grid


def _percent_table(values: Any, where: str) -> dict[str, dict[str, float]]:
    """``{row: number | {metric: number}}`` as ``{row: {metric: number}}``."""
    if not isinstance(values, dict):
        raise ConfigError(f"{where} must map row names to the paper's numbers")
    out: dict[str, dict[str, float]] = {}
    for row, value in values.items():
        if isinstance(value, int | float) and not isinstance(value, bool):
            out[str(row)] = {"": float(value)}
        elif isinstance(value, dict) and all(
            isinstance(v, int | float) and not isinstance(v, bool) for v in value.values()
        ):
            out[str(row)] = {str(k): float(v) for k, v in value.items()}
        else:
            raise ConfigError(f"{where}.{row} must be a number or a mapping of metrics to numbers")
    return out


def _rows(algorithms: Any, metric: str, where: str) -> dict[str, Row]:
    if algorithms is None:
        algorithms = {name: {} for name in DEFAULT_ALGORITHMS}
    if not isinstance(algorithms, dict) or not algorithms:
        raise ConfigError(f"{where}: 'algorithms' must map row names to settings")
    rows: dict[str, Row] = {}
    for name, spec in algorithms.items():
        name = str(name)
        if "/" in name or name.startswith("."):
            raise ConfigError(f"{where}: row name {name!r} cannot hold '/' or start with '.'")
        spec = {} if spec is None else spec
        if not isinstance(spec, dict):
            raise ConfigError(f"{where}: algorithms.{name} must be a mapping of settings")
        settings = check_settings(
            {k: v for k, v in spec.items() if k not in ROW_KEYS}, f"{where}: algorithms.{name}"
        )
        same = spec.get("same_run_as")
        if same is not None and settings:
            raise ConfigError(
                f"{where}: algorithms.{name} has same_run_as, so it takes only 'metric'"
            )
        rows[name] = Row(
            name,
            str(spec.get("algorithm", name)),
            settings,
            str(spec.get("metric", metric)),
            None if same is None else str(same),
        )
    return _resolve_same_runs(rows, where)


def _resolve_same_runs(rows: dict[str, Row], where: str) -> dict[str, Row]:
    """The rows with each ``same_run_as`` row running its source's algorithm (which must be
    another row with its own runs)."""
    for row in list(rows.values()):
        source = rows.get(row.same_run_as) if row.same_run_as else None
        if row.same_run_as and (source is None or source.same_run_as):
            raise ConfigError(
                f"{where}: algorithms.{row.name}.same_run_as={row.same_run_as!r} must name "
                "another row that has its own runs"
            )
        if source is not None:
            rows[row.name] = Row(row.name, source.algorithm, {}, row.metric, row.same_run_as)
    return rows


def _datasets(values: Any, where: str) -> tuple[str, ...]:
    """A ``data`` list: registered dataset names."""
    from pflego.data import DATASETS

    values = [values] if isinstance(values, str) else list(values or [])
    for dataset in values:
        if dataset not in DATASETS:
            raise ConfigError(
                f"{where} names unknown dataset {dataset!r}; choose from {', '.join(sorted(DATASETS))}"
            )
    return tuple(str(d) for d in values)


def _paper_numbers(
    values: Any, key: str, groups: Iterable[str] | None, rows: dict[str, Row], where: str
) -> dict[str, dict[str, dict[str, float]]]:
    """``paper_results`` / ``paper_std``: group (block) -> row -> metric -> number."""
    out: dict[str, dict[str, dict[str, float]]] = {}
    for group, table in (values or {}).items():
        if groups is not None and str(group) not in groups:
            raise ConfigError(f"{where}: {key}.{group} is not a block ({', '.join(groups)})")
        for row, by_metric in _percent_table(table, f"{where}: {key}.{group}").items():
            if row not in rows:
                raise ConfigError(f"{where}: {key}.{group}.{row} is not a row")
            out.setdefault(str(group), {})[row] = {
                (k or rows[row].metric): v for k, v in by_metric.items()
            }
    return out


def _blocks(values: Any, rows: dict[str, Row], where: str) -> tuple[dict, dict, dict]:
    """A ``blocks`` mapping: each block's settings, its datasets and its row overrides."""
    values = values or {ALL: {}}
    if not isinstance(values, dict):
        raise ConfigError(f"{where}: 'blocks' must map block names to settings")
    blocks, block_data, block_rows = {}, {}, {}
    for block, spec in values.items():
        block, spec = str(block), spec or {}
        here = f"{where}: blocks.{block}"
        if "/" in block or block.startswith("."):
            raise ConfigError(f"{where}: block name {block!r} cannot hold '/' or start with '.'")
        if not isinstance(spec, dict):
            raise ConfigError(f"{here} must be a mapping of settings")
        blocks[block] = check_settings({k: v for k, v in spec.items() if k not in BLOCK_KEYS}, here)
        if "data" in spec:
            block_data[block] = _datasets(spec["data"], f"{here}.data")
        overrides = spec.get("algorithms") or {}
        if not isinstance(overrides, dict):
            raise ConfigError(f"{here}.algorithms must map rows to settings")
        for row, settings in overrides.items():
            _own_runs(row, rows, f"{here}.algorithms.{row}")
            block_rows.setdefault(block, {})[str(row)] = check_settings(
                settings, f"{here}.algorithms.{row}"
            )
    return blocks, block_data, block_rows


def _own_runs(row: Any, rows: dict[str, Row], where: str) -> None:
    """Fail unless ``row`` names a row with its own runs (not ``same_run_as`` another)."""
    if str(row) not in rows or rows[str(row)].same_run_as:
        raise ConfigError(f"{where} is not a row with its own runs")


def _tune(values: Any, rows: dict[str, Row], where: str) -> dict[str, list[tuple[str, list]]]:
    """``tune``: row -> its grid."""
    tune = {}
    for row, grid in (values or {}).items():
        _own_runs(row, rows, f"{where}: tune.{row}")
        tune[str(row)] = _grid(grid, f"{where}: tune.{row}")
    return tune


def _sweep(values: Any, where: str) -> tuple[str, list[Any]] | None:
    """``sweep``: one setting and its values, or ``None``."""
    if values is None:
        return None
    grid = _grid(values, f"{where}: sweep")
    if len(grid) != 1:
        raise ConfigError(f"{where}: sweep takes exactly one setting and its values")
    return grid[0]


def _table_measures(values: dict[str, Any], results: dict, std: dict) -> None:
    """Add the table-like quantities beside the main metric to ``results`` and ``std``: rounds to
    reach ``target_acc`` and the per-client gain over the ``local`` row ([mean, std] over
    clients), block -> row -> number."""
    for block, table in (values.get("paper_rounds_to_target") or {}).items():
        for row, rounds in table.items():
            results.setdefault(str(block), {}).setdefault(row, {})["rounds_to_target"] = float(
                rounds
            )
    for block, table in (values.get("paper_gain_over_local") or {}).items():
        for row, (mean, spread) in table.items():
            results.setdefault(str(block), {}).setdefault(row, {})["gain_over_local"] = float(mean)
            std.setdefault(str(block), {}).setdefault(row, {})["gain_over_local"] = float(spread)


def _target_and_ranked(values: dict[str, Any], where: str) -> tuple[float | None, bool]:
    """``target_acc`` (an accuracy in (0, 1], or unset) and ``ranked`` (true or false)."""
    target = values.get("target_acc")
    check_value("target_acc", target, TARGET_ACC, f"{where}: ")
    ranked = values.get("ranked", False)
    if not isinstance(ranked, bool):
        raise ConfigError(f"{where}: ranked={ranked!r} must be true or false")
    return None if target is None else float(target), ranked


def parse_preset(values: dict[str, Any], name: str) -> Preset:
    """Check a preset mapping and build the :class:`Preset` (one-line errors naming the key)."""
    where = f"preset {name}"
    if not isinstance(values, dict):
        raise ConfigError(f"{where} must be a mapping")
    if "settings" not in values and "algorithms" not in values:  # a plain config file
        values = {"settings": values}
    unknown = sorted(set(values) - set(PRESET_KEYS))
    if unknown:
        raise ConfigError(
            f"{where}: unknown key {unknown[0]!r}; valid keys: {', '.join(PRESET_KEYS)}"
        )
    metric = str(values.get("metric") or DEFAULT_METRIC)
    rows = _rows(values.get("algorithms"), metric, where)
    blocks, block_data, block_rows = _blocks(values.get("blocks"), rows, where)
    tune = _tune(values.get("tune"), rows, where)
    sweep = _sweep(values.get("sweep"), where)
    paper_results = _paper_numbers(
        values.get("paper_results"), "paper_results", blocks, rows, where
    )
    paper_std = _paper_numbers(values.get("paper_std"), "paper_std", blocks, rows, where)
    _table_measures(values, paper_results, paper_std)
    target, ranked = _target_and_ranked(values, where)
    return Preset(
        name=name,
        description=str(values.get("description") or ""),
        paper=str(values.get("paper") or ""),
        source=str(values.get("source") or ""),
        data=_datasets(values.get("data"), f"{where}: data"),
        settings=check_settings(values.get("settings"), f"{where}: settings"),
        quick=check_settings(values.get("quick"), f"{where}: quick"),
        offline=check_settings(values.get("offline"), f"{where}: offline"),
        blocks=blocks,
        block_data=block_data,
        block_rows=block_rows,
        rows=rows,
        metric=metric,
        paper_results=paper_results,
        paper_std=paper_std,
        paper_groups=_paper_numbers(
            values.get("paper_results_by_group"), "paper_results_by_group", None, rows, where
        ),
        tune=tune,
        sweep=sweep,
        target_acc=target,
        ranked=ranked,
    )


def shipped_presets() -> dict[str, Any]:
    """The preset files shipped in ``pflego.configs``, by name."""
    folder = resources.files("pflego.configs")
    return {
        Path(entry.name).stem: entry
        for entry in sorted(folder.iterdir(), key=lambda e: e.name)
        if entry.name.endswith(".yaml")
    }


def load_preset(name: str | Path) -> Preset:
    """A shipped preset by name (``pflego-mnist``), or a preset YAML file by path."""
    shipped = shipped_presets()
    if str(name) in shipped:
        try:
            values = yaml.safe_load(shipped[str(name)].read_text())
        except yaml.YAMLError:
            raise ConfigError(f"preset {name} is not valid YAML") from None
        return parse_preset(values or {}, str(name))
    path = Path(name)
    if path.suffix in (".yaml", ".yml") or path.exists():
        return parse_preset(read_yaml(path), path.stem)
    raise ConfigError(
        f"unknown preset {str(name)!r}; `pflego reproduce --list` shows them: {', '.join(shipped)}"
    )


def list_presets() -> list[Preset]:
    """Every shipped preset, parsed (a broken one raises its one-line error)."""
    return [load_preset(name) for name in shipped_presets()]
