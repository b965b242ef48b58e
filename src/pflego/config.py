"""Experiment configuration: one frozen dataclass, loaded from YAML, dicts or CLI overrides.

Each setting is declared once, as a field with its meaning and rule (:mod:`pflego.fields`);
:meth:`Config.validate` checks those rules and the rules between settings, before any data is
loaded, and fails with a one-line message that names the setting and the fix.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import math
import types
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from pflego.errors import ConfigError
from pflego.fields import (
    Rule,
    between,
    check_value,
    non_negative,
    one_of,
    positive,
    positive_number,
    positive_or_unset,
    rule_of,
    setting,
)

SAMPLING = ("fixed", "bernoulli", "uniform-count")
LABELS = ("global", "local")
BACKENDS = ("auto", "vmap", "graph", "fused", "loop")
#: Experiment trackers of the ``log`` setting -> the module each needs (its extra has its name).
TRACKERS = {"tensorboard": "tensorboard", "mlflow": "mlflow", "wandb": "wandb"}
MAX_COUNT = 2**31 - 1  # counts (clients, rounds, steps, sizes) index tensors
#: Seeds are offset and passed to torch generators, which take 64-bit integers.
SEED = Rule(lambda v: 0 <= v <= 2**62, "must lie in 0..2**62", "0..2**62")


@dataclass(frozen=True)
class Config:
    """Everything that defines a run. Field names are the YAML keys and ``--set`` names; each
    field declares what it means and the rule its value keeps (``docs/settings.md`` lists them)."""

    algorithm: str = setting("pflego", "the method (`pflego list` shows them)")
    dataset: str = setting(
        "mnist5k", "the data: a built-in name, or hf:NAME[:CONFIG], hf:FOLDER, hf:FILE.parquet"
    )
    data_dir: str | None = setting(None, "where datasets are read and downloaded")
    model: str = setting("auto", "the model; auto picks the dataset's default")
    hf_label: str | None = setting(None, "an hf: dataset's label column (found when unset)")
    hf_features: str | None = setting(
        None, "an hf: dataset's input columns, comma-separated (found when unset)"
    )
    hf_client: str | None = setting(
        None, "an hf: dataset's column naming each sample's client (a writer id), for natural"
    )
    hf_coarse: str | None = setting(
        None, "an hf: dataset's coarse labels (superclasses of the labels), for pachinko"
    )
    partition: str = setting(
        "auto",
        "how samples are dealt to clients; auto: natural where the data has natural "
        "clients, else classes",
    )
    classes_per_client: int | str = setting(
        "high",
        "classes each client holds (partition classes): a number, or high (2), medium "
        "(half the classes), none (all)",
    )
    labels: str = setting(
        "global",
        "global: one C-way head; local: heads over each client's own classes",
        one_of(*LABELS),
    )
    alpha: float = setting(0.5, "Dirichlet concentration of the dirichlet-like partitions")
    min_client_size: int = setting(
        2, "the fewest samples a client may hold (moved to it from the largest clients)"
    )
    test_fraction: float = setting(0.25, "the share of each client's samples held out for testing")
    pool_test: bool = setting(
        False, "merge an official test split into the data before test_fraction splits it"
    )
    val_fraction: float = setting(
        0.0,
        "the share of each client's training samples held out for validation",
        between(0, 1, "[)"),
    )
    pachinko_beta: float = setting(
        10.0, "Dirichlet concentration over the fine labels of partition pachinko", positive
    )
    clients: int = setting(50, "the number of clients", positive)
    unseen_fraction: float = setting(
        0.0,
        "the share of clients that never train and join only at evaluation",
        between(0, 1, "[)").noting(
            ": the share of clients that never train and join only at evaluation"
        ),
    )
    join_epochs: float | None = setting(
        None,
        "epochs an unseen client personalizes for (unset: the run's local schedule)",
        positive_or_unset,
    )
    participation: float = setting(
        0.2,
        "the fraction of clients per round",
        between(0, 1, "(]").noting(": the fraction of clients per round"),
    )
    sampling: str = setting(
        "fixed",
        "how a round's cohort is drawn: a fixed count, each client by a coin "
        "(bernoulli), or a count drawn in min_cohort..max_cohort",
        one_of(*SAMPLING),
    )
    min_cohort: int | None = setting(None, "the smallest cohort of sampling=uniform-count")
    max_cohort: int | None = setting(None, "the largest cohort of sampling=uniform-count")
    rounds: int = setting(100, "communication rounds", positive)
    inner_steps: int = setting(50, "local steps per client and round", positive)
    local_epochs: float | None = setting(
        None, "local epochs per round instead of inner_steps", positive_or_unset
    )
    batch_size: int | None = setting(
        None, "local minibatch size (unset: the whole client)", positive_or_unset
    )
    client_lr: float | None = setting(
        None, "the clients' step size (unset: the method's default)", positive
    )
    server_lr: float | None = setting(
        None, "the server's step size (unset: the method's default)", positive
    )
    client_optimizer: str = setting("sgd", "the optimizer of the local steps")
    server_optimizer: str = setting("sgd", "the optimizer of the server's step")
    momentum: float = setting(0.9, "momentum of the momentum optimizers", between(0, 1, "[)"))
    weight_decay: float = setting(
        0.0,
        "L2 weight decay in the clients' local steps",
        non_negative.noting(" (L2 in the clients' local steps)"),
    )
    head_init: str = setting(
        "linear",
        "how heads start: linear (U(+-1/sqrt(M)), as nn.Linear), uniform (U(0, 1), "
        "as the PFLEGO code) or zeros",
    )
    options: dict[str, Any] = setting(
        meaning="the method's own options (`pflego list` shows them)", factory=dict
    )
    seed: int = setting(0, "the seed of data, partition, models and sampling", SEED)
    eval_every: int = setting(10, "rounds between evaluations", positive)
    average_last: int = setting(
        10, "the final result averages the last this many rounds' evaluations", non_negative
    )
    eval_clients: int | None = setting(
        None, "evaluate a fixed sample of this many clients (unset: all)", positive_or_unset
    )
    eval_train_samples: int | None = setting(
        None,
        "training samples per client the training metrics read (unset: all)",
        positive_or_unset,
    )
    checkpoint_every: int = setting(10, "rounds between checkpoints", positive)
    divergence: str = setting(
        "stop",
        "when the training loss explodes: stop (exit code 3) or warn",
        one_of("stop", "warn"),
    )
    backend: str = setting(
        "auto",
        "how clients train: vmap (vectorized), graph (vmap over static shapes, replayed as "
        "CUDA graphs on a GPU), fused (hand-derived steps), loop, or auto (the fastest that fits)",
        one_of(*BACKENDS),
    )
    chunk_size: int | None = setting(
        None,
        "at most this many clients vectorized at once (unset: as memory allows)",
        positive_or_unset,
    )
    device: str = setting("cpu", "cpu, cuda or cuda:N")
    dtype: str = setting(
        "float32", "the floating-point type of parameters and data", one_of("float32", "float64")
    )
    out: str | None = setting(None, "the run's folder")
    log: str | None = setting(
        None, "experiment trackers, comma-separated: tensorboard, mlflow, wandb"
    )
    log_dir: str | None = setting(
        None, "where trackers write (unset: the run's or experiment's folder)"
    )
    dp_clip: float | None = setting(
        None,
        "differential privacy (docs/privacy.md): the clipping norm C of each upload",
        positive_number,
    )
    dp_noise: float | None = setting(
        None, "the noise multiplier sigma (needs dp_clip)", non_negative
    )
    dp_target_epsilon: float | None = setting(
        None, "a target epsilon that picks sigma (instead of dp_noise)", positive
    )
    dp_delta: float = setting(1e-5, "the delta of the privacy guarantee", between(0, 1, "()"))
    dp_local: bool = setting(False, "each client adds its own noise instead of the server")

    def replace(self, **changes: Any) -> Config:
        """A validated copy with some fields changed."""
        return from_dict({**to_dict(self), **changes})

    def dataset_settings(self) -> dict[str, str]:
        """The settings set for the dataset's loader (the ``hf_`` columns of an ``hf:`` dataset)."""
        values = {name: getattr(self, name) for name in FIELDS if name.startswith("hf_")}
        return {name: value for name, value in values.items() if value is not None}

    def validate(self) -> Config:
        """Check every setting's declared rule, then the rules between settings; returns
        ``self`` so calls chain."""
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            check_number(field.name, value)
            check_value(field.name, value, rule_of(field))
        if self.join_epochs is not None and self.unseen_fraction == 0:
            raise ConfigError(
                f"join_epochs={self.join_epochs} sets how long clients that never trained "
                "personalize, but unseen_fraction=0 holds none out; set unseen_fraction or unset it"
            )
        self.check_cohort_range()
        if self.dataset_settings() and not self.dataset.startswith("hf:"):
            name, value = next(iter(self.dataset_settings().items()))
            raise ConfigError(
                f"{name}={value} names a column of a Hugging Face dataset, but dataset="
                f"{self.dataset} is not one (hf:NAME); unset it"
            )
        # dp_: a clipping norm under any noise, one way to pick sigma
        noised = self.dp_noise is not None or self.dp_target_epsilon is not None or self.dp_local
        if noised and self.dp_clip is None:
            raise ConfigError("dp_noise, dp_target_epsilon and dp_local need dp_clip (the norm C)")
        if self.dp_noise is not None and self.dp_target_epsilon is not None:
            raise ConfigError(
                "give dp_noise (sigma) or dp_target_epsilon (which picks it), not both"
            )
        tracker_names(self.log)
        check_device(self.device)
        return self

    def check_cohort_range(self) -> None:
        """``min_cohort`` / ``max_cohort`` are set, 1 <= min <= max, for (and only for)
        ``sampling=uniform-count``; the population bound is checked once the data is known."""
        counted = self.sampling == "uniform-count"
        for name, value in {"min_cohort": self.min_cohort, "max_cohort": self.max_cohort}.items():
            if not counted and value is not None:
                raise ConfigError(
                    f"{name}={value} applies only to sampling=uniform-count; unset it or "
                    "set sampling=uniform-count"
                )
            if counted and (value is None or value < 1):
                raise ConfigError(
                    f"sampling=uniform-count needs {name} >= 1 (got {value}); set "
                    "--min-cohort and --max-cohort"
                )
        if counted and self.min_cohort > self.max_cohort:
            raise ConfigError(f"min_cohort={self.min_cohort} exceeds max_cohort={self.max_cohort}")


def tracker_names(log: str | None) -> list[str]:
    """The trackers a ``log`` setting names (comma-separated), each known and installed.

    Raises:
        ConfigError: An unknown name, an empty list, or a tracker whose package is missing (one
            line naming the extra that installs it).
    """
    import importlib.util

    if log is None:
        return []
    names = list(dict.fromkeys(part.strip() for part in log.split(",")))
    for name in names:
        if name not in TRACKERS:
            raise ConfigError(
                f"log={log!r}: {name!r} is not a tracker; choose from {', '.join(TRACKERS)} "
                "(comma-separated)"
            )
    for name in names:
        if importlib.util.find_spec(TRACKERS[name]) is None:
            raise ConfigError(
                f"log={name} needs the {TRACKERS[name]} package: pip install 'pflego[{name}]'"
            )
    return names


def check_device(device: str) -> None:
    """Fail with one line unless ``device`` is ``cpu``, or ``cuda[:N]`` with that GPU present."""
    import torch

    kind, _, index = device.partition(":")
    if kind not in ("cpu", "cuda") or (index and (kind == "cpu" or not index.isdigit())):
        raise ConfigError(f"device={device!r} is not one of cpu, cuda, cuda:N")
    if kind == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError(f"device={device!r} but no CUDA GPU is available; use device=cpu")
        if index and int(index) >= torch.cuda.device_count():
            raise ConfigError(
                f"device={device!r} but only {torch.cuda.device_count()} CUDA GPU(s) exist"
            )


FIELDS = {f.name: f for f in dataclasses.fields(Config)}
HINTS = typing.get_type_hints(Config)


def check_number(name: str, value: Any) -> None:
    """Every number is finite, and every count (an int other than the seed) fits an index."""
    if isinstance(value, float) and not math.isfinite(value):
        raise ConfigError(f"{name}={value} must be a finite number")
    if type(value) is int and name != "seed" and abs(value) > MAX_COUNT:
        raise ConfigError(f"{name}={value} is too large (at most {MAX_COUNT})")


def _fits(kind: Any, value: Any) -> bool:
    """Whether ``value`` already is a ``kind`` (an int is a float too; a bool is no number)."""
    kind = typing.get_origin(kind) or kind  # dict[str, Any] -> dict
    if isinstance(value, bool):
        return kind is bool
    return isinstance(value, int | float if kind is float else kind)


def _coerce(name: str, value: Any) -> Any:
    """Convert a YAML / CLI value to the field's type, or fail with a clear message."""
    hint = HINTS[name]
    allowed = typing.get_args(hint) if isinstance(hint, types.UnionType) else (hint,)
    unset = value is None or (isinstance(value, str) and value.lower() in ("none", "null"))
    if unset and type(None) in allowed:
        return None
    if value is None:  # a word such as none stays a word where no unset value exists
        raise ConfigError(f"{name} cannot be empty")  # (classes_per_client: high | medium | none)
    for kind in allowed:  # the value as it is first (a mapping copied), then strings as numbers
        if _fits(kind, value):
            return float(value) if kind is float else copy.copy(value)
    for kind in allowed:
        if kind in (int, float) and isinstance(value, str):
            with contextlib.suppress(ValueError):
                return kind(value)
    names = " or ".join(getattr(k, "__name__", str(k)) for k in allowed if k is not type(None))
    raise ConfigError(f"{name}={value!r} must be {names}")


def from_dict(values: dict[str, Any]) -> Config:
    """A validated config from a mapping; unknown keys are errors."""
    if not isinstance(values, dict):
        raise ConfigError("a config must be a mapping of setting names to values")
    unknown = sorted(set(values) - set(FIELDS))
    if unknown:
        raise ConfigError(f"unknown setting {unknown[0]!r}; valid settings: {', '.join(FIELDS)}")
    return Config(**{k: _coerce(k, v) for k, v in values.items()}).validate()


def to_dict(config: Config) -> dict[str, Any]:
    """The config as plain values (the form written to ``config.yaml``)."""
    return dataclasses.asdict(config)


def read_yaml(path: str | Path) -> dict[str, Any]:
    """Read a YAML mapping from a file, with one-line errors."""
    path = Path(path)
    if not path.exists():
        raise ConfigError(f"config file {path} does not exist")
    if not path.is_file():
        raise ConfigError(f"config file {path} is not a regular file; pass a YAML file")
    try:
        values = yaml.safe_load(path.read_bytes().decode("utf-8")) or {}
    except OSError as exc:
        raise ConfigError(f"config file {path} cannot be read ({exc.strerror})") from None
    except UnicodeDecodeError:
        raise ConfigError(f"config file {path} is not UTF-8 text; pass a YAML file") from None
    except yaml.YAMLError as exc:
        where = getattr(exc, "problem_mark", None)
        line = f" at line {where.line + 1}" if where else ""
        raise ConfigError(f"config file {path} is not valid YAML{line}; fix its syntax") from None
    if not isinstance(values, dict):
        raise ConfigError(f"config file {path} must hold a mapping of setting names to values")
    return values


def parse_overrides(pairs: list[str]) -> dict[str, Any]:
    """``key=value`` strings (values parsed as YAML; ``options.k=v`` sets an algorithm option)."""
    values: dict[str, Any] = {}
    for pair in pairs:
        key, sep, raw = pair.partition("=")
        if not sep or not key:
            raise ConfigError(f"--set {pair!r} must look like key=value")
        try:
            value = yaml.safe_load(raw) if raw else None
        except yaml.YAMLError:
            value = raw
        if key.startswith("options."):
            values.setdefault("options", {})[key[len("options.") :]] = value
        else:
            values[key] = value
    return values


def load_config(
    source: Config | dict[str, Any] | str | Path | None = None, **overrides: Any
) -> Config:
    """A validated config from a ``Config``, a dict, a YAML path or nothing, plus overrides."""
    if isinstance(source, Config):
        base = to_dict(source)
    elif source is None or isinstance(source, dict):
        base = dict(source or {})
    else:
        base = read_yaml(source)
    if "options" in overrides and "options" in base:
        overrides["options"] = {**base["options"], **overrides["options"]}
    return from_dict({**base, **overrides})
