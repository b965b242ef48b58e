"""pflego: personalized federated learning, with PFLEGO at its centre.

Quick start::

    import pflego
    history = pflego.run({"algorithm": "pflego", "rounds": 20})
    print(history.final())

The names below are imported on first use, so that ``import pflego`` (and the ``pflego`` command,
which must answer Ctrl-C in one line at any moment) does not import torch until it is needed.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from pflego._version import __version__ as __version__

_EXPORTS = {
    "Config": "pflego.config",
    "load_config": "pflego.config",
    "ConfigError": "pflego.errors",
    "DataError": "pflego.errors",
    "PflegoError": "pflego.errors",
    "History": "pflego.history",
    "compare": "pflego.experiments.reproduce",
    "resume": "pflego.sim",
    "run": "pflego.sim",
}
__all__ = [
    "Config",
    "ConfigError",
    "DataError",
    "History",
    "PflegoError",
    "compare",
    "load_config",
    "resume",
    "run",
]


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'pflego' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value
    return value


if TYPE_CHECKING:
    from pflego.config import Config, load_config
    from pflego.errors import ConfigError, DataError, PflegoError
    from pflego.experiments.reproduce import compare
    from pflego.history import History
    from pflego.sim import resume, run
