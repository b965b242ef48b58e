"""``pflego bench``: speed, client FLOPs and memory of the simulator, measured in one process.

Its sections: wall clock by backend and client FLOPs as the local steps tau grow
(:mod:`~pflego.bench.shared`), peak memory and scale in fresh processes
(:mod:`~pflego.bench.fresh_process`), the comparison with the conventional way of running rounds
(:mod:`~pflego.bench.against`) and runs over processes (:mod:`~pflego.bench.parallel`);
:mod:`~pflego.bench.report` assembles them.
"""

from pflego.bench.command import add_commands
from pflego.bench.fresh_process import scale_row
from pflego.bench.report import run_bench

__all__ = ["add_commands", "run_bench", "scale_row"]
