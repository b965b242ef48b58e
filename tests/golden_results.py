"""Golden results: every preset's ``--quick`` numbers, kept in ``tests/golden/<preset>.json``.

A test reruns them and compares within the tolerances stored in each file, so a baseline that
drifts between versions fails CI instead of changing silently. Each preset has up to two forms:

- ``offline``: the quick version on data that needs no files (the preset's own data when it is
  built in, e.g. ``mnist5k``; else its ``offline`` stand-in, e.g. ``mnist5k`` for MNIST-family and
  CIFAR-10 presets). Checked by the default test suite on any machine.
- ``real``: the quick version on the preset's own data files. Recorded with ``--real`` where the
  files are present, and checked by the slow suite (``pytest -m slow``) where they are.

Regenerate after an intended change of results::

    python tests/golden_results.py --update [PRESET ...] [--real --data-dir DIR]
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from pflego.errors import PflegoError
from pflego.experiments import measures as M
from pflego.experiments.presets import Preset, list_presets, load_preset
from pflego.experiments.runs import Plan, build_plan, check_data
from pflego.history import History

#: Absolute tolerance on accuracies (fractions) and relative tolerance on losses. CPU float32
#: results agree to ~1e-6 between runs on one machine; other BLAS builds move a quick run's
#: losses by ~1e-5 relative, and can flip a near-tie prediction (one test sample of one client
#: is at most 1/n_test of that client's accuracy). A change of an algorithm's maths moves them
#: by far more.
TOLERANCE = {"accuracy_abs": 0.01, "loss_rel": 1e-3}
KEYS = ("train_loss", "test_acc", "test_acc_p10", "test_acc_weighted")
FORMS = ("offline", "real")


def golden_dir() -> Path:
    """``tests/golden``, beside this file."""
    return Path(__file__).resolve().parent / "golden"


def unregistered(preset: Preset) -> list[str]:
    """The algorithms the preset's rows name that are not registered (yet)."""
    from pflego.algorithms import ALGORITHMS

    return sorted({r.algorithm for r in preset.rows.values()} - set(ALGORITHMS))


def form_plan(preset: Preset, form: str, data_dir: str | None = None) -> Plan | None:
    """The quick plan of a form, or ``None`` when the preset has no such form.

    The offline form keeps the blocks whose data is built in (after the ``offline`` stand-ins);
    the real form is the quick version on the preset's own data, when that needs files.
    """
    from pflego.data import DATASETS

    if form == "offline":
        plan = build_plan(preset, "golden", [0], quick=True, offline=bool(preset.offline))
        files = {r.block for r in plan.runs if DATASETS[r.config["dataset"]].needs_data_dir}
        plan.runs = [r for r in plan.runs if r.block not in files]
        return plan if plan.runs else None
    own = preset.data or (preset.settings.get("dataset", "mnist5k"),)
    own = (*own, *(d for b in preset.block_data.values() for d in b))
    if not any(DATASETS[d].needs_data_dir for d in own):
        return None  # the preset's own data is built in: the offline form covers it
    overrides = {"data_dir": data_dir} if data_dir else {}
    return build_plan(preset, "golden", [0], quick=True, overrides=overrides)


def config_key(config: dict[str, Any]) -> str:
    """Runs with equal settings (but where their data lies) give equal numbers."""
    return json.dumps(
        {k: v for k, v in config.items() if k not in ("data_dir", "out")}, sort_keys=True
    )


def run_metrics(history: History, config: dict[str, Any], metric: str) -> dict[str, float]:
    keys = dict.fromkeys((*KEYS, metric))
    return {k: M.final_value(history, k, config["average_last"]) for k in keys}


def compute(
    plan: Plan, workdir: Path, cache: dict[str, dict[str, float]] | None = None
) -> dict[str, dict[str, float]]:
    """Each run's final metrics (``run.dir`` -> key -> value); equal configs run once (``cache``)."""
    from pflego.config import from_dict
    from pflego.sim import build_experiment, run_experiment

    cache = {} if cache is None else cache
    metric = {r["name"]: r["metric"] for r in plan.rows}
    out = {}
    for k, run in enumerate(plan.unique_runs()):
        key = config_key(run.config) + metric[run.row]
        if key not in cache:
            history = run_experiment(
                build_experiment(from_dict(run.config)), workdir / f"run-{k}", False
            )
            cache[key] = run_metrics(history, run.config, metric[run.row])
        out[run.dir] = cache[key]
    return out


def check(
    name: str,
    form: str,
    workdir: Path,
    cache: dict[str, dict[str, float]] | None = None,
    data_dir: str | None = None,
) -> list[str]:
    """Rerun a preset's form (runs already in ``cache`` are not repeated) against its golden file.

    Returns:
        The mismatches (empty when everything is within the file's tolerances).
    """
    path = golden_dir() / f"{name}.json"
    if not path.is_file():
        return [f"no golden file {path}; run python tests/golden_results.py --update {name}"]
    golden = json.loads(path.read_text())
    expected = golden["forms"].get(form)
    plan = form_plan(load_preset(name), form, data_dir)
    if (expected is None) != (plan is None):
        return [f"{name}: the {form} form changed; update the golden file"]
    if plan is None:
        return []
    actual = compute(plan, workdir, cache)
    return mismatches(expected["runs"], actual, golden["tolerance"])


def mismatches(
    expected: dict[str, dict[str, float]],
    actual: dict[str, dict[str, float]],
    tolerance: dict[str, float],
) -> list[str]:
    """Lines naming every run and metric outside the tolerance (or missing)."""
    problems = []
    for run, values in expected.items():
        if run not in actual:
            problems.append(f"{run}: not run")
            continue
        for key, want in values.items():
            got = actual[run].get(key, math.nan)
            if want is None or (isinstance(want, float) and math.isnan(want)):
                ok = got is None or math.isnan(got)
            elif M.is_accuracy(key):
                ok = abs(got - want) <= tolerance["accuracy_abs"]
            else:
                ok = abs(got - want) <= tolerance["loss_rel"] * max(abs(want), 1e-12)
            if not ok:
                problems.append(f"{run}: {key} {got!r} != golden {want!r}")
    problems += [f"{run}: not in the golden file" for run in actual if run not in expected]
    return problems


def nan_to_none(values: dict[str, dict[str, float]]) -> dict[str, dict[str, float | None]]:
    return {
        run: {k: None if math.isnan(v) else v for k, v in m.items()} for run, m in values.items()
    }


def update(names: Sequence[str], real: bool, data_dir: str | None, folder: Path) -> list[str]:
    """Rewrite the golden files of ``names`` (the offline form; the real one with ``real``)."""
    folder.mkdir(parents=True, exist_ok=True)
    written, cache = [], {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in names:
            preset = load_preset(name)
            missing = unregistered(preset)
            if missing:
                print(f"{name}: skipped, algorithms not registered: {', '.join(missing)}")
                continue
            path = folder / f"{preset.name}.json"
            old = json.loads(path.read_text()) if path.is_file() else {}
            forms: dict[str, Any] = {}
            for form in FORMS:
                plan = form_plan(preset, form, data_dir)
                if plan is None:
                    forms[form] = None
                    continue
                if form == "real" and not real:
                    forms[form] = old.get("forms", {}).get("real")
                    continue
                try:
                    check_data(plan)
                except PflegoError as exc:
                    print(f"{name}: real form skipped ({exc})", file=sys.stderr)
                    forms[form] = old.get("forms", {}).get("real")
                    continue
                forms[form] = {
                    "datasets": sorted({r.config["dataset"] for r in plan.runs}),
                    "runs": nan_to_none(compute(plan, Path(tmp) / f"{name}-{form}", cache)),
                }
            golden = {
                "preset": preset.name,
                "about": "Final metrics (fractions; mean of the last average_last rounds) of the "
                "preset's --quick runs, seed 0. Regenerate: python tests/golden_results.py "
                "--update " + preset.name,
                "torch": torch.__version__.split("+")[0],
                "tolerance": TOLERANCE,
                "forms": forms,
            }
            path.write_text(json.dumps(golden, indent=1, sort_keys=False) + "\n")
            written.append(str(path))
    return written


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python tests/golden_results.py", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("presets", nargs="*", help="presets to update (default every shipped one)")
    parser.add_argument("--update", action="store_true", help="rerun and rewrite the golden files")
    parser.add_argument(
        "--real", action="store_true", help="also the real-data forms (needs the files)"
    )
    parser.add_argument("--data-dir", help="folder with the presets' data files")
    parser.add_argument(
        "--dir", type=Path, default=None, help="golden folder (default tests/golden)"
    )
    args = parser.parse_args(argv)
    if not args.update:
        parser.error("nothing to do: pass --update (the check is the test suite's)")
    torch.set_num_threads(1)
    names = args.presets or [p.name for p in list_presets()]
    try:
        for path in update(names, args.real, args.data_dir, args.dir or golden_dir()):
            print(path)
    except PflegoError as exc:
        print(f"pflego: error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
