"""The flags that several ``pflego`` commands take, each defined once, and what reads them back.

:data:`RUN_SETTINGS` holds the experiment settings that have a flag of their own (``--client-lr``
sets ``client_lr``); :data:`FLAGS` every other flag that more than one command takes (a command
may give it a help of its own where its default differs). The ``add_*`` functions add a group of
them to a command's parser, in the order its ``--help`` lists them; :func:`settings_from_args` and
:func:`server_run_config` turn the parsed flags back into settings. A flag that only one command
takes is defined beside that command.
"""

from __future__ import annotations

import argparse
import copy
from pathlib import Path
from typing import Any

from pflego.cli.session import default_threads
from pflego.errors import ConfigError
from pflego.fields import check_value

#: config key -> help of the settings with a flag of their own, in ``--help`` order; the flag is
#: the key with dashes. The help gains the setting's default (and its choices, see :func:`choices`).
RUN_SETTINGS = {
    "algorithm": "algorithm",
    "dataset": "dataset",
    "data_dir": "folder with the dataset files",
    "model": "architecture (auto: the dataset's default; mlpN: an MLP of N hidden units)",
    "partition": "how samples are split over clients",
    "classes_per_client": "K for the classes partition: an integer or high (2) | medium (C/2) | "
    "none (C)",
    "alpha": "Dirichlet concentration for the dirichlet, natural-dirichlet and pachinko partitions",
    "clients": "number of clients I",
    "participation": "fraction of clients per round, in (0, 1]",
    "sampling": "how a round's clients are drawn (fixed: exactly r; bernoulli: each with "
    "probability p; uniform-count: r uniform in [--min-cohort, --max-cohort] each round)",
    "min_cohort": "smallest cohort of sampling=uniform-count",
    "max_cohort": "largest cohort of sampling=uniform-count",
    "rounds": "number of rounds T",
    "inner_steps": "local steps per round (tau)",
    "local_epochs": "local epochs instead of a fixed number of steps",
    "batch_size": "minibatch size",
    "client_lr": "client step size (beta)",
    "server_lr": "server step size (rho)",
    "client_optimizer": "client optimizer",
    "server_optimizer": "server optimizer",
    "seed": "random seed",
    "eval_every": "evaluate every this many rounds",
    "backend": "simulator backend (auto: fused on CPU where every local step fuses, else vmap; "
    "loop: one client at a time, the reference)",
    "device": "torch device: cpu, cuda or cuda:N",
    "dp_clip": "differential privacy: clip each upload to this L2 norm C",
    "dp_noise": "differential privacy: noise multiplier sigma (std sigma x C)",
    "dp_target_epsilon": "differential privacy: pick sigma for this epsilon",
    "dp_delta": "differential privacy: the delta epsilon is reported at",
    "log": "experiment trackers, comma-separated: tensorboard | mlflow | wandb (offline files in "
    "the run's or experiment's folder, or --set log_dir=DIR)",
}
#: config key -> help of the on/off settings
RUN_SETTING_SWITCHES = {"dp_local": "differential privacy: noise on each client instead"}


def flag_of(key: str) -> str:
    """The flag of a setting: ``client_lr`` -> ``--client-lr``."""
    return "--" + key.replace("_", "-")


#: (flag, config key, help) of :data:`RUN_SETTINGS`
RUN_FLAGS = [(flag_of(key), key, text) for key, text in RUN_SETTINGS.items()]
#: (flag, config key, help) of :data:`RUN_SETTING_SWITCHES`
RUN_SWITCHES = [(flag_of(key), key, text) for key, text in RUN_SETTING_SWITCHES.items()]

#: How unset (``None``) defaults read in ``--help``.
UNSET = {
    "data_dir": "$PFLEGO_DATA, else ~/.cache/pflego/data",
    "local_epochs": "unset: --inner-steps steps",
    "batch_size": "unset: the whole local set every step",
    "log": "none: metrics.jsonl only",
}

SEEDS_METAVAR = "K|S1,S2,..."


def at_least_one(text: str) -> int:
    """An integer flag that counts something (``--jobs``): 1 or more."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} must be at least 1")
    return value


#: flag -> the keywords of ``add_argument``, for the flags that several commands take.
FLAGS: dict[str, dict[str, Any]] = {
    # the rest of the run flags (after the settings)
    "--config": {"type": Path, "help": "YAML file of settings; flags override it (default: none)"},
    "--set": {
        "dest": "overrides",
        "action": "append",
        "default": [],
        "metavar": "KEY=VALUE",
        "help": "override any setting, e.g. --set average_last=5 --set options.head_step=eq3 "
        "(default: none; `pflego run --help` lists the flags, config.yaml of a run every key)",
    },
    "--out": {
        "type": Path,
        "help": "output directory (default: runs/<algorithm>-<dataset>-<date>-<time>)",
    },
    "--quiet": {"action": "store_true", "help": "no progress bar"},
    "--no-verify": {
        "action": "store_true",
        "help": "use local dataset files even when they do not match the official checksums "
        "(a warning instead of an error; also PFLEGO_NO_VERIFY=1)",
    },
    # experiments of several runs
    "--seeds": {
        "metavar": SEEDS_METAVAR,
        "help": "run with seeds 0..K-1 (or the seeds listed) and report mean ± std and each seed "
        "(default: the single seed of the settings)",
    },
    "--tune-seeds": {"metavar": SEEDS_METAVAR, "help": "seeds of the grid runs (default 0)"},
    "--jobs": {
        "type": at_least_one,
        "default": 1,
        "metavar": "N",
        "help": "run the experiment's runs on N worker processes, each with --threads threads "
        "(default: the CPU cores / N) and a device of --devices (default 1: one after another)",
    },
    "--devices": {
        "metavar": "D1,D2,...",
        "help": "devices given to the workers round-robin, e.g. cpu or cuda:0,cuda:1 "
        "(default: each run's --device)",
    },
    "--target-acc": {
        "type": float,
        "metavar": "FRACTION",
        "help": "also report the first round whose accuracy reaches this, e.g. 0.7 "
        "(default: not reported)",
    },
    # continuing (each command says what it continues)
    "--resume": {"type": Path, "metavar": "DIR"},
    "--overwrite": {
        "action": "store_true",
        "help": "replace what pflego wrote in --out (a run, comparison, reproduction, tuning or "
        "report; other files stay); without it such a folder is refused",
    },
    # the Flower server's run config (flower local, flower run-config)
    "--input-shape": {
        "default": "",
        "help": "the model's input, e.g. 1,28,28 (default: what the nodes report)",
    },
    "--label-names": {
        "default": "",
        "help": "the run's label names, e.g. cat,dog (default: every label the nodes report)",
    },
    "--secure-aggregation": {
        "action": "store_true",
        "help": "sum the uploads with Flower's SecAgg+ (weighted-sum aggregates only)",
    },
    "--secagg-clipping-range": {"type": float, "default": 8.0, "help": "SecAgg+ clipping range R"},
    "--secagg-quantization-range": {
        "type": int,
        "default": 2**22,
        "help": "SecAgg+ quantization levels Q (step 2R/Q)",
    },
    "--round-timeout": {
        "type": float,
        "default": 120.0,
        "help": "seconds to wait for a round's replies",
    },
    # a Flower run on this machine (flower local, flower simulate)
    "--nodes": {"type": int, "help": "number of SuperNodes, one client each (default: --clients)"},
    "--timeout": {"type": float, "default": 3600.0, "help": "seconds the whole run may take"},
    "--workdir": {
        "type": Path,
        "help": "keep Flower's home and logs here (the nodes' states are kept in --out) "
        "(default: a temporary folder, removed when the command ends)",
    },
    "--no-netns": {
        "dest": "netns",
        "action": "store_false",
        "help": "do not run inside a private network namespace (default: use one where possible)",
    },
}


#: The Flower server's flags, in ``--help`` order.
SERVER_FLAGS = (
    "--input-shape",
    "--label-names",
    "--secure-aggregation",
    "--secagg-clipping-range",
    "--secagg-quantization-range",
    "--round-timeout",
)


def add_flag(parser: argparse.ArgumentParser, flag: str, **changes: Any) -> None:
    """Add one flag of :data:`FLAGS`, with the keywords in ``changes`` replaced (e.g. its help)."""
    parser.add_argument(flag, **copy.deepcopy({**FLAGS[flag], **changes}))


def add_flags(parser: argparse.ArgumentParser, *flags: str) -> None:
    """Add flags of :data:`FLAGS` as they are defined there."""
    for flag in flags:
        add_flag(parser, flag)


def choices() -> dict[str, list[str]]:
    """The allowed values of the settings that have a fixed set of them (shown in ``--help``)."""
    from pflego.algorithms import ALGORITHMS
    from pflego.config import BACKENDS, SAMPLING
    from pflego.data import DATASETS, FAMILIES
    from pflego.data.partition import PARTITIONS
    from pflego.models import ARCHITECTURES
    from pflego.optim import OPTIMIZERS

    return {
        "algorithm": sorted(ALGORITHMS),
        "dataset": [*sorted(DATASETS), *(family.usage for family in FAMILIES.values())],
        "model": ["auto", *sorted(ARCHITECTURES)],
        "partition": list(PARTITIONS),
        "sampling": list(SAMPLING),
        "backend": list(BACKENDS),
        "client_optimizer": sorted(OPTIMIZERS),
        "server_optimizer": sorted(OPTIMIZERS),
    }


def add_threads_flag(parser: argparse.ArgumentParser) -> None:
    """``--threads`` (every command)."""
    parser.add_argument(
        "--threads",
        type=int,
        metavar="N",
        help="torch CPU threads (default: $OMP_NUM_THREADS if set, else half the CPU cores, "
        f"at most 4; here {default_threads()})",
    )


def step_size_default(key: str) -> str:
    """How ``--help`` shows the default of ``client_lr`` or ``server_lr``: the algorithms' own
    defaults (those that differ from the library's), as ``pflego list`` prints them."""
    from pflego.algorithms import ALGORITHMS
    from pflego.algorithms.base import Algorithm

    attribute = f"default_{key}"
    library = getattr(Algorithm, attribute)
    own = {
        name: getattr(cls, attribute)
        for name, cls in sorted(ALGORITHMS.items())
        if getattr(cls, attribute) != library
    }
    listed = ", ".join(f"{name} {value:g}" for name, value in own.items())
    return f"the algorithm's: {listed}; others {library:g}; see `pflego list`"


def add_run_setting(
    parser: argparse.ArgumentParser,
    key: str,
    allowed: list[str] | None = None,
    shown: str | None = None,
) -> None:
    """The flag of one of :data:`RUN_SETTINGS`, its help ending in its ``allowed`` values and
    its default (``shown``: the command's own, where it is not the setting's)."""
    from pflego.config import FIELDS

    text = RUN_SETTINGS[key]
    if allowed:
        text += f"; one of: {' | '.join(allowed)}"
    default = FIELDS[key].default
    if shown is None and key in ("client_lr", "server_lr"):
        shown = step_size_default(key)
    elif shown is None:
        shown = UNSET.get(key, default) if default is None else default
    parser.add_argument(flag_of(key), dest=key, default=None, help=f"{text} (default: {shown})")


def add_run_flags(
    parser: argparse.ArgumentParser,
    without: tuple[str, ...] = (),
    defaults: dict[str, str] | None = None,
    out: str | None = None,
) -> None:
    """The flags of ``pflego run`` (also used by ``compare``, ``tune`` and ``flower``).

    Args:
        parser: The command's parser.
        without: Settings the command refuses as flags (they are not listed).
        defaults: Setting -> how ``--help`` shows the command's own default of it.
        out: ``--out``'s help, where the command's default differs from ``run``'s.
    """
    allowed = choices()
    for _, key, _ in RUN_FLAGS:
        if key not in without:
            add_run_setting(parser, key, allowed.get(key), (defaults or {}).get(key))
    for flag, key, text in RUN_SWITCHES:
        parser.add_argument(flag, dest=key, action="store_const", const=True, help=text)
    add_flags(parser, "--config", "--set")
    add_flag(parser, "--out", **({"help": out} if out else {}))
    add_flags(parser, "--quiet", "--no-verify")


def add_server_flags(parser: argparse.ArgumentParser) -> None:
    """Flags of the Flower server's run config (task, secure aggregation, timeouts)."""
    add_flags(parser, *SERVER_FLAGS)


def settings_from_args(args: argparse.Namespace) -> dict[str, Any]:
    """The settings given on the command line (flags, then --set overrides)."""
    from pflego.config import parse_overrides

    values = {
        key: getattr(args, key)
        for _, key, _ in RUN_FLAGS + RUN_SWITCHES
        if getattr(args, key, None) is not None
    }
    return {**values, **parse_overrides(args.overrides)}


def server_run_config(args: argparse.Namespace) -> dict[str, Any]:
    """The run config entries of :func:`add_server_flags`."""
    run: dict[str, Any] = {"input-shape": args.input_shape, "label-names": args.label_names}
    if args.secure_aggregation:
        run |= {
            "secure-aggregation": True,
            "secagg-clipping-range": float(args.secagg_clipping_range),
            "secagg-quantization-range": int(args.secagg_quantization_range),
        }
    return run


def resume_rounds(args: argparse.Namespace, others: list[str], kept: str) -> int | None:
    """``--rounds`` given with ``--resume`` (``None`` if not); any other setting is refused.

    A continued run keeps its settings: every run flag but ``--rounds``, each ``--set`` and the
    command's own ``others`` are refused in one line.

    Args:
        args: the parsed flags.
        others: the command's own flags that were given and that ``--resume`` refuses too.
        kept: where the continued run's settings come from, e.g. ``its config.yaml``.
    """
    from pflego.config import load_config

    given = [
        flag for flag, key, _ in RUN_FLAGS if key != "rounds" and getattr(args, key) is not None
    ]
    given += [f"--set {pair}" for pair in args.overrides] + others
    if given:
        raise ConfigError(
            f"--resume continues {args.resume} with the settings in {kept}; only --rounds may "
            f"change (remove {', '.join(given)})"
        )
    return None if args.rounds is None else load_config(rounds=args.rounds).rounds


def workers_from_args(args: argparse.Namespace) -> Any:
    """The :class:`~pflego.experiments.parallel.Workers` of ``--jobs``, ``--devices`` and
    ``--threads``."""
    from pflego.experiments.parallel import Workers, parse_devices

    return Workers(args.jobs, parse_devices(args.devices), getattr(args, "threads", None))


def check_target(value: float | None) -> float | None:
    """``--target-acc``, a fraction in (0, 1] or ``None``."""
    from pflego.experiments.presets import TARGET_ACC

    check_value("--target-acc", value, TARGET_ACC)
    return value


def parse_names(text: str | None) -> list[str] | None:
    """A comma-separated list of names (``None`` stays ``None``; empty is an error)."""
    if text is None:
        return None
    parts = [p.strip() for p in text.split(",") if p.strip()]
    if not parts:
        raise ConfigError("an empty list of names; give at least one")
    return parts
