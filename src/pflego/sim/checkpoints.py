"""Runs into directories: start a run, and resume a stopped one from its last checkpoint (with
exactly the numbers of an uninterrupted run) or extend a finished one."""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from pflego.config import Config, load_config, read_yaml, to_dict
from pflego.errors import ConfigError
from pflego.history import History, RunDir, check_new_run_dir
from pflego.sim.build import Experiment, build_experiment
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


def run(
    config: Config | dict[str, Any] | str | Path | None = None,
    out: str | Path | None = None,
    progress: bool = True,
    overwrite: bool = False,
    profile: bool | Profile = False,
    **overrides: Any,
) -> History:
    """Run one experiment and write its directory.

    Args:
        config: A ``Config``, a dict of settings, a YAML path, or ``None`` for the defaults.
        out: The run directory (default ``config.out`` or ``runs/<algorithm>-<dataset>-<time>``).
        progress: Show a progress bar.
        overwrite: Replace a run that ``out`` already holds (otherwise a ``ConfigError``).
        profile: Write ``profile.json`` (seconds spent on data, train, evaluate, checkpoint and
            the rest) into the run directory; a :class:`Profile` also counts what came before.
        **overrides: Settings that replace those in ``config``.

    Returns:
        The run's :class:`History`.
    """
    timer = profile if isinstance(profile, Profile) else Profile()
    cfg = load_config(config, **overrides)
    out = Path(out or cfg.out or default_out(cfg)).expanduser()
    check_new_run_dir(out, overwrite)
    with timer.part("data"):
        experiment = build_experiment(cfg)
    return run_experiment(experiment, out, progress, timer if profile else None)


def resume(
    run_dir: str | Path,
    progress: bool = True,
    rounds: int | None = None,
    announce: Callable[[str], None] | None = None,
) -> History:
    """Continue a stopped run from its last checkpoint; the result equals an uninterrupted run.

    A run stopped before its first checkpoint (nothing trained yet) starts again from round 0.
    Checkpoints hold every client's state, so a run resumes under any number of processes
    (:func:`pflego.sim.distributed.resume`).

    Args:
        run_dir: The run directory.
        progress: Show a progress bar.
        rounds: Extend the run to this many rounds in all (the only setting that may change).
        announce: Called with one line that says what is resumed (for the command line).
    """
    plan = plan_resume(run_dir, rounds, announce)
    experiment = build_experiment(plan.config)
    if plan.state is None:
        return run_experiment(experiment, run_dir, progress)
    simulation = Simulation(experiment, plan.directory)
    load_state(simulation, plan.state, plan.directory.checkpoint)
    plan.directory.rewind(simulation.records, simulation.next_round)
    plan.directory.write_partition(experiment.partition_summary())  # a function of the config
    plan.directory.record_environment(experiment.environment())
    return simulation.run(progress)


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
