"""Experiments as one command: paper presets, several seeds, tuning on validation data, reports.

The preset format is :mod:`~pflego.experiments.presets`; a preset's runs are planned, checked and
run by :mod:`~pflego.experiments.runs`; the commands are in :mod:`~pflego.experiments.reproduce`
and :mod:`~pflego.experiments.tune`; reports (``report_*``) are rebuilt from run directories
alone. User documentation: ``docs/experiments.md``.
"""

from importlib import import_module
from typing import Any

#: Public names and their modules; imported on first use, so ``pflego --help`` stays fast.
_EXPORTS = {
    "Preset": "presets",
    "list_presets": "presets",
    "load_preset": "presets",
    "build_report": "report",
    "write_report": "report",
    "compare": "reproduce",
    "reproduce": "reproduce",
    "run_seeds": "reproduce",
    "parse_seeds": "seeds",
    "tune": "tune",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'pflego.experiments' has no attribute {name!r}")
    return getattr(import_module(f"pflego.experiments.{_EXPORTS[name]}"), name)
