"""The in-process simulator: build an experiment, run its rounds, evaluate, checkpoint, resume.

Modules, from the bottom up: :mod:`~pflego.sim.clients` (client data pools, also of generated
populations, schedules and the state store), :mod:`~pflego.sim.backends` (how a cohort trains:
loop, vmap, fused), :mod:`~pflego.sim.metrics` (per-client metrics), :mod:`~pflego.sim.privacy`
(differential privacy of a round), :mod:`~pflego.sim.build` (an experiment from its settings),
:mod:`~pflego.sim.guards` and :mod:`~pflego.sim.profile`, :mod:`~pflego.sim.engine` (one round for
every transport, the training loop with its callbacks, and when a run evaluates),
:mod:`~pflego.sim.rounds` (the simulator's rounds and evaluation), :mod:`~pflego.sim.checkpoints`
(run directories), and one run across processes with torch.distributed: :mod:`~pflego.sim.group`
(the process group and its collectives) and :mod:`~pflego.sim.distributed` (``run`` and
``resume``, with ``nproc`` and torchrun, and one process's part of a run across processes).
This package's face holds the names other layers use.
"""

from pflego.sim.build import (
    Experiment,
    build_algorithm_for,
    build_experiment,
    experiment_on,
    partition,
    with_step_sizes,
)
from pflego.sim.checkpoints import default_out, run_experiment
from pflego.sim.distributed import launch, resume, run
from pflego.sim.engine import evaluation_due, evaluation_record, evaluation_sample
from pflego.sim.profile import Profile, process_age
from pflego.sim.rounds import Simulation

__all__ = [
    "Experiment",
    "Profile",
    "Simulation",
    "build_algorithm_for",
    "build_experiment",
    "default_out",
    "evaluation_due",
    "evaluation_record",
    "evaluation_sample",
    "experiment_on",
    "launch",
    "partition",
    "process_age",
    "resume",
    "run",
    "run_experiment",
    "with_step_sizes",
]
