"""Experiment configuration: one frozen dataclass, loaded from YAML, dicts or CLI overrides.

Every check happens here, before any data is loaded, and fails with a one-line message that
names the setting and the fix.
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from pflego.errors import ConfigError

SAMPLING = ("fixed", "bernoulli", "uniform-count")
LABELS = ("global", "local")
BACKENDS = ("auto", "vmap", "fused", "loop")
DTYPES = ("float32", "float64")
#: Experiment trackers of the ``log`` setting -> the module each needs (its extra has its name).
TRACKERS = {"tensorboard": "tensorboard", "mlflow": "mlflow", "wandb": "wandb"}
DATASET_SETTINGS = ("hf_label", "hf_features", "hf_client", "hf_coarse")
#: What a run whose training loss explodes (finite) does: stop with exit code 3, or warn.
DIVERGENCE = ("stop", "warn")
MAX_SEED = 2**62  # seeds are offset and passed to torch generators, which take 64-bit integers
MAX_COUNT = 2**31 - 1  # counts (clients, rounds, steps, sizes) index tensors


@dataclass(frozen=True)
class Config:
    """Everything that defines a run. Field names are the YAML keys and ``--set`` names."""

    algorithm: str = "pflego"
    dataset: str = "mnist5k"  # or hf:NAME[:CONFIG], hf:FOLDER, hf:FILE.parquet (Hugging Face)
    data_dir: str | None = None
    model: str = "auto"
    # The columns of an hf: dataset (found when unset): its labels, its inputs (comma-separated)
    # the natural client of each sample (a writer id) for partition natural, and coarse labels
    # (superclasses of the labels) for partition pachinko.
    hf_label: str | None = None
    hf_features: str | None = None
    hf_client: str | None = None
    hf_coarse: str | None = None
    partition: str = "auto"  # natural for datasets with natural clients, else classes
    classes_per_client: int | str = "high"
    labels: str = "global"
    alpha: float = 0.5
    min_client_size: int = 2
    test_fraction: float = 0.25
    pool_test: bool = False  # merge an official test split into the data, then test_fraction
    val_fraction: float = 0.0
    pachinko_beta: float = 10.0
    clients: int = 50
    unseen_fraction: float = 0.0
    join_epochs: float | None = None  # unseen clients personalize for this many epochs
    participation: float = 0.2
    sampling: str = "fixed"
    min_cohort: int | None = None
    max_cohort: int | None = None
    rounds: int = 100
    inner_steps: int = 50
    local_epochs: float | None = None
    batch_size: int | None = None
    client_lr: float | None = None  # None: the algorithm's default_client_lr
    server_lr: float | None = None  # None: the algorithm's default_server_lr
    client_optimizer: str = "sgd"
    server_optimizer: str = "sgd"
    momentum: float = 0.9
    weight_decay: float = 0.0
    head_init: str = "linear"
    options: dict[str, Any] = field(default_factory=dict)
    seed: int = 0
    eval_every: int = 10
    average_last: int = 10
    eval_clients: int | None = None
    eval_train_samples: int | None = None
    checkpoint_every: int = 10
    divergence: str = "stop"  # stop: exit 3 when the loss explodes (pflego.sim.guards); warn
    backend: str = "auto"
    chunk_size: int | None = None
    device: str = "cpu"
    dtype: str = "float32"
    out: str | None = None
    log: str | None = None  # experiment trackers, comma-separated: tensorboard, mlflow, wandb
    log_dir: str | None = None  # where trackers write (default: the run's or experiment's folder)
    # Differential privacy of the uploads (docs/privacy.md): clipping norm C, noise multiplier
    # sigma or a target epsilon that picks it, delta, and noise on each client instead.
    dp_clip: float | None = None
    dp_noise: float | None = None
    dp_target_epsilon: float | None = None
    dp_delta: float = 1e-5
    dp_local: bool = False

    def replace(self, **changes: Any) -> Config:
        """A validated copy with some fields changed."""
        return from_dict({**to_dict(self), **changes})

    def dataset_settings(self) -> dict[str, str]:
        """The settings set for the dataset's loader (the ``hf_`` columns of an ``hf:`` dataset)."""
        values = {name: getattr(self, name) for name in DATASET_SETTINGS}
        return {name: value for name, value in values.items() if value is not None}

    def validate(self) -> Config:
        """Check ranges and choices; returns ``self`` so calls chain."""
        for name in FIELDS:
            value = getattr(self, name)
            if isinstance(value, float) and not math.isfinite(value):
                raise ConfigError(f"{name}={value} must be a finite number")
            if type(value) is int and name != "seed" and abs(value) > MAX_COUNT:
                raise ConfigError(f"{name}={value} is too large (at most {MAX_COUNT})")
        positive = {
            "clients": self.clients,
            "rounds": self.rounds,
            "inner_steps": self.inner_steps,
            "eval_every": self.eval_every,
            "checkpoint_every": self.checkpoint_every,
        }
        for name, value in positive.items():
            if not value > 0:
                raise ConfigError(f"{name}={value} must be positive")
        for name in ("client_lr", "server_lr"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ConfigError(f"{name}={value} must be positive")
        for name in (
            "batch_size",
            "local_epochs",
            "chunk_size",
            "join_epochs",
            "eval_clients",
            "eval_train_samples",
        ):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ConfigError(f"{name}={value} must be positive (or unset)")
        if not 0 < self.participation <= 1:
            raise ConfigError(
                f"participation={self.participation} must lie in (0, 1]: the fraction of clients per round"
            )
        if not 0 <= self.val_fraction < 1:
            raise ConfigError(f"val_fraction={self.val_fraction} must lie in [0, 1)")
        if not 0 <= self.unseen_fraction < 1:
            raise ConfigError(
                f"unseen_fraction={self.unseen_fraction} must lie in [0, 1): the share of clients "
                "that never train and join only at evaluation"
            )
        if self.join_epochs is not None and self.unseen_fraction == 0:
            raise ConfigError(
                f"join_epochs={self.join_epochs} sets how long clients that never trained "
                "personalize, but unseen_fraction=0 holds none out; set unseen_fraction or unset it"
            )
        if not self.pachinko_beta > 0:
            raise ConfigError(f"pachinko_beta={self.pachinko_beta} must be positive")
        if not 0 <= self.seed <= MAX_SEED:
            raise ConfigError(f"seed={self.seed} must lie in 0..2**62")
        if self.average_last < 0:
            raise ConfigError(f"average_last={self.average_last} must be 0 or more")
        if not self.weight_decay >= 0:
            raise ConfigError(
                f"weight_decay={self.weight_decay} must be 0 or more (L2 in the clients' local steps)"
            )
        if not 0 <= self.momentum < 1:
            raise ConfigError(f"momentum={self.momentum} must lie in [0, 1)")
        self.check_cohort_range()
        if self.dataset_settings() and not self.dataset.startswith("hf:"):
            name, value = next(iter(self.dataset_settings().items()))
            raise ConfigError(
                f"{name}={value} names a column of a Hugging Face dataset, but dataset="
                f"{self.dataset} is not one (hf:NAME); unset it"
            )
        for name, choices in (
            ("sampling", SAMPLING),
            ("labels", LABELS),
            ("backend", BACKENDS),
            ("dtype", DTYPES),
            ("divergence", DIVERGENCE),
        ):
            if getattr(self, name) not in choices:
                raise ConfigError(
                    f"{name}={getattr(self, name)!r} is not one of {', '.join(choices)}"
                )
        self.validate_privacy()
        tracker_names(self.log)
        check_device(self.device)
        if not isinstance(self.options, dict):
            raise ConfigError("options must be a mapping of algorithm option names to values")
        return self

    def check_cohort_range(self) -> None:
        """``min_cohort`` / ``max_cohort`` are set, 1 <= min <= max, for (and only for)
        ``sampling=uniform-count``; the population bound is checked once the data is known."""
        bounds = {"min_cohort": self.min_cohort, "max_cohort": self.max_cohort}
        if self.sampling != "uniform-count":
            for name, value in bounds.items():
                if value is not None:
                    raise ConfigError(
                        f"{name}={value} applies only to sampling=uniform-count; unset it or "
                        "set sampling=uniform-count"
                    )
            return
        for name, value in bounds.items():
            if value is None or value < 1:
                raise ConfigError(
                    f"sampling=uniform-count needs {name} >= 1 (got {value}); set "
                    "--min-cohort and --max-cohort"
                )
        if self.min_cohort > self.max_cohort:
            raise ConfigError(f"min_cohort={self.min_cohort} exceeds max_cohort={self.max_cohort}")

    def validate_privacy(self) -> None:
        """The dp_ settings: a positive clipping norm under any noise, one way to pick sigma."""
        noised = self.dp_noise is not None or self.dp_target_epsilon is not None or self.dp_local
        if noised and self.dp_clip is None:
            raise ConfigError("dp_noise, dp_target_epsilon and dp_local need dp_clip (the norm C)")
        if self.dp_noise is not None and self.dp_target_epsilon is not None:
            raise ConfigError(
                "give dp_noise (sigma) or dp_target_epsilon (which picks it), not both"
            )
        if self.dp_clip is not None and not 0 < self.dp_clip < math.inf:
            raise ConfigError(f"dp_clip={self.dp_clip} must be a positive number")
        if self.dp_noise is not None and not 0 <= self.dp_noise < math.inf:
            raise ConfigError(f"dp_noise={self.dp_noise} must be 0 or more")
        if self.dp_target_epsilon is not None and not 0 < self.dp_target_epsilon < math.inf:
            raise ConfigError(f"dp_target_epsilon={self.dp_target_epsilon} must be positive")
        if not 0 < self.dp_delta < 1:
            raise ConfigError(f"dp_delta={self.dp_delta} must lie in (0, 1)")


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


def _coerce(name: str, value: Any) -> Any:
    """Convert a YAML / CLI value to the field's type, or fail with a clear message."""
    hint = typing.get_type_hints(Config)[name]
    allowed = typing.get_args(hint) if isinstance(hint, types.UnionType) else (hint,)
    unset = value is None or (isinstance(value, str) and value.lower() in ("none", "null"))
    if unset and type(None) in allowed:
        return None
    if value is None:  # a word such as none stays a word where no unset value exists
        raise ConfigError(f"{name} cannot be empty")  # (classes_per_client: high | medium | none)
    for kind in allowed:
        if kind is bool and isinstance(value, bool):
            return value
        if kind is int and isinstance(value, int) and not isinstance(value, bool):
            return value
        if kind is float and isinstance(value, int | float) and not isinstance(value, bool):
            return float(value)
        if kind is str and isinstance(value, str):
            return value
        if typing.get_origin(kind) is dict and isinstance(value, dict):
            return dict(value)
    for kind in allowed:  # strings from the command line
        if isinstance(value, str) and kind in (int, float):
            try:
                return kind(value)
            except ValueError:
                continue
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
    elif isinstance(source, dict):
        base = dict(source)
    elif source is None:
        base = {}
    else:
        base = read_yaml(source)
    if "options" in overrides and "options" in base:
        overrides["options"] = {**base["options"], **overrides["options"]}
    return from_dict({**base, **overrides})
