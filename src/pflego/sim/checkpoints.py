"""One process's runs into directories: a built experiment run into one, and the checks and the
loading of a resumption from the last checkpoint (exactly the numbers of an uninterrupted run) or
of the extension of a finished run (``run`` and ``resume``: :mod:`pflego.sim.distributed`)."""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from pflego.config import Config, load_config, read_yaml, to_dict
from pflego.errors import ConfigError
from pflego.history import History, RunDir
from pflego.sim.build import Experiment
from pflego.sim.profile import Profile
from pflego.sim.rounds import Simulation


def default_out(config: Config) -> Path:
    stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
    dataset = re.sub(r"[^\w.-]+", "-", config.dataset).strip("-")  # hf:/a/b -> hf-a-b
    return Path("runs") / f"{config.algorithm}-{dataset}-{stamp}"


def run_experiment(
    experiment: Experiment,
    out: str | Path,
    progress: bool = True,
    profile: Profile | None = None,
) -> History:
    """Run a built experiment into the directory ``out``.

    With ``profile``, ``profile.json`` in the run directory says where the time went.
    """
    run_dir = RunDir(out)
    timer = profile or Profile()
    with timer.part("data"):
        run_dir.start(
            to_dict(experiment.config), experiment.partition_summary(), experiment.environment()
        )
    simulation = Simulation(experiment, run_dir, timer)
    history = simulation.run(progress)
    if profile is not None:
        run_dir.write_profile(simulation.profile_summary())
    return history


def reopen(
    run_dir: RunDir, simulation: Simulation, experiment: Experiment, environment: dict[str, Any]
) -> None:
    """Bring a resumed run's directory back to its checkpoint: the log rewound to the rounds it
    holds, the partition (a function of the config) and this process's environment rewritten."""
    run_dir.rewind(simulation.records, simulation.next_round)
    run_dir.write_partition(experiment.partition_summary())
    run_dir.record_environment(environment)


@dataclass(frozen=True)
class Resumption:
    """A checked resumption: the run directory, its config and its checkpoint.

    Attributes:
        directory: The run directory.
        config: The run's config (its rounds extended, if asked).
        state: The checkpoint; ``None`` for a run stopped before its first one.
    """

    directory: RunDir
    config: Config
    state: dict[str, Any] | None


def plan_resume(
    run_dir: str | Path,
    rounds: int | None = None,
    announce: Callable[[str], None] | None = None,
) -> Resumption:
    """Check that ``run_dir`` can be resumed (extended to ``rounds``), write its extended config,
    and say what is resumed; a one-line ``ConfigError`` otherwise."""
    if not Path(run_dir).is_dir():
        raise ConfigError(f"run directory {run_dir} does not exist")
    directory = RunDir(run_dir)
    if not directory.config.is_file():
        raise ConfigError(f"{run_dir} has no config.yaml; is it a pflego run directory?")
    cfg = load_config(read_yaml(directory.config))
    say = announce or (lambda line: None)
    if not directory.checkpoint.is_file():
        if rounds is not None:
            cfg = cfg.replace(rounds=rounds)
        say(
            f"{run_dir} was stopped before its first checkpoint: running {cfg.algorithm} on "
            f"{cfg.dataset} from round 0 to {cfg.rounds}"
        )
        return Resumption(directory, cfg, None)
    state = directory.load_checkpoint()
    if state.get("kind") == "flower-server":
        raise ConfigError(
            f"{run_dir} is a Flower run; continue it with `pflego flower local --resume {run_dir}` "
            "or the ServerApp's run config resume = true"
        )
    done, planned = state["next_round"], cfg.rounds
    if rounds is not None and rounds != cfg.rounds:
        if cfg.dp_target_epsilon is not None:
            raise ConfigError(
                f"{run_dir} picked its noise for epsilon {cfg.dp_target_epsilon:g} over "
                f"{cfg.rounds} rounds; it cannot be extended (start a new run)"
            )
        if rounds < done:
            raise ConfigError(
                f"rounds={rounds} is fewer than the {done} rounds {run_dir} has already run"
            )
        cfg = cfg.replace(rounds=rounds)
        directory.write_config(to_dict(cfg))
    saved = state.get("config", {})
    changed = sorted(k for k, v in to_dict(cfg).items() if k != "rounds" and saved.get(k, v) != v)
    if changed:
        raise ConfigError(
            f"{directory.config} does not match the run's checkpoint ({changed[0]}="
            f"{to_dict(cfg)[changed[0]]!r}, but the checkpoint has {saved[changed[0]]!r}); "
            "restore it or start a new run"
        )
    change = f" (was {planned})" if cfg.rounds != planned else ""
    if done >= cfg.rounds:
        say(f"{run_dir} has already run all {cfg.rounds} rounds; pass --rounds N to extend it")
    else:
        say(
            f"resuming {run_dir}: {cfg.algorithm} on {cfg.dataset} from round {done} "
            f"to {cfg.rounds}{change}"
        )
    return Resumption(directory, cfg, state)


def load_state(simulation: Simulation, state: dict[str, Any], checkpoint: Path) -> None:
    """Load the state of the file ``checkpoint`` into a simulation; one line when it does not
    fit the run."""
    try:
        simulation.load_state_dict(state)
    except (KeyError, TypeError, ValueError, IndexError, RuntimeError, AttributeError) as exc:
        raise ConfigError(
            f"{checkpoint} does not fit this run ({type(exc).__name__}); start a new run"
        ) from None
