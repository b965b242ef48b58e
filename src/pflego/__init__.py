"""pflego: personalized federated learning, with PFLEGO at its centre.

Quick start::

    import pflego
    history = pflego.run({"algorithm": "pflego", "rounds": 20})
    print(history.final())
"""

from pflego.config import Config, load_config
from pflego.errors import ConfigError, DataError, PflegoError
from pflego.history import History
from pflego.report import compare
from pflego.sim.runner import resume, run

__version__ = "0.1.0"
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
