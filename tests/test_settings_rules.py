"""Settings are declared once, on their fields (meaning and rule), and checked by one function
that config files, ``--set``, presets, options and direct construction all reach."""

from __future__ import annotations

import dataclasses

import pytest

from pflego.algorithms import ALGORITHMS
from pflego.algorithms.base import Algorithm, check_options
from pflego.config import load_config
from pflego.errors import ConfigError
from pflego.experiments.presets import parse_preset
from pflego.experiments.runs import build_plan
from pflego.fields import (
    at_least,
    between,
    check_fields,
    one_of,
    positive,
    rule_of,
    setting,
)


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"clients": 0}, "clients=0 must be positive"),
        ({"batch_size": 0}, "batch_size=0 must be positive (or unset)"),
        ({"participation": 0}, "participation=0.0 must lie in (0, 1]: the fraction of clients"),
        ({"val_fraction": 1}, "val_fraction=1.0 must lie in [0, 1)"),
        ({"seed": -1}, "seed=-1 must lie in 0..2**62"),
        ({"weight_decay": -1}, "weight_decay=-1.0 must be 0 or more (L2 in the clients'"),
        ({"sampling": "every"}, "sampling='every' is not one of fixed, bernoulli, uniform-count"),
        ({"dtype": "float16"}, "dtype='float16' is not one of float32, float64"),
        ({"dp_clip": 0.0}, "dp_clip=0.0 must be a positive number"),
        ({"dp_clip": float("inf")}, "dp_clip=inf must be a finite number"),
        ({"rounds": "many"}, "rounds='many' must be int"),
        ({"clients": 2**40}, "clients=1099511627776 is too large"),
    ],
)
def test_a_setting_that_breaks_its_rule_is_one_line_naming_it(settings, message):
    with pytest.raises(ConfigError) as info:
        load_config(settings)
    assert str(info.value).startswith(message) and "\n" not in str(info.value)


def test_command_line_strings_become_numbers():
    config = load_config({"rounds": "3", "client_lr": "0.5", "batch_size": "none"})
    assert (config.rounds, config.client_lr, config.batch_size) == (3, 0.5, None)


def test_an_option_out_of_range_is_refused_before_any_model_exists():
    """A preset's plan checks option ranges with its configs (they were checked only when the
    algorithm was built)."""
    with pytest.raises(ConfigError, match=r"^fedala eta=0.0 must be positive$"):
        check_options("fedala", {"eta": 0})
    with pytest.raises(ConfigError, match=r"^cfl linkage='average' must be one of complete, "):
        check_options("cfl", {"linkage": "average"})
    preset = parse_preset({"algorithms": {"fedprox": {"options": {"mu": -1}}}}, "p")
    with pytest.raises(ConfigError, match=r"^fedprox mu=-1.0 must be 0 or more$"):
        build_plan(preset, "compare")


def test_an_algorithm_built_directly_checks_the_same_rules():
    with pytest.raises(ConfigError, match=r"^pfedme K=0 must be at least 1$"):
        ALGORITHMS["pfedme"](model=None, K=0)
    with pytest.raises(ConfigError, match=r"^apfl alpha=x must lie in \[0, 1\]$"):
        ALGORITHMS["apfl"](model=None, alpha="x")  # a wrong type is a ConfigError too
    assert ALGORITHMS["fedrep"](model=None, head_steps=None).head_steps is None  # (or unset)


def test_rules_and_their_messages():
    @dataclasses.dataclass(frozen=True)
    class Example:
        count: int = setting(1, "how many", at_least(1))
        share: float = setting(0.5, "a share", between(0, 1, "(]"))
        kind: str = setting("a", "which", one_of("a", "b"))
        limit: float | None = setting(None, "a bound", positive)

    check_fields(Example())
    for changes, message in [
        ({"count": 0}, "count=0 must be at least 1"),
        ({"share": 0.0}, "share=0.0 must lie in (0, 1]"),
        ({"kind": "c"}, "kind='c' is not one of a, b"),
        ({"limit": 0.0}, "limit=0.0 must be positive"),
        ({"kind": None}, "kind=None is not one of a, b"),  # None passes only where it may
    ]:
        with pytest.raises(ConfigError) as info:
            check_fields(Example(**changes), "x ")
        assert str(info.value) == f"x {message}"
    check_fields(Example(limit=None))
    assert rule_of(dataclasses.fields(Example)[0]).doc == ">= 1"


def test_no_algorithm_checks_its_options_by_hand():
    """Option rules are declared on the fields; only a rule between an option and another
    setting keeps a ``__post_init__`` (FedNova: mu with the momentum optimizer; FedBN and MOCHA:
    the model they are meant for; FedAP, a FedBN, drops FedBN's rule: without batch norm the
    body's features stand in)."""
    own = {
        name
        for name, cls in ALGORITHMS.items()
        if any("__post_init__" in vars(k) for k in cls.__mro__ if k is not Algorithm)
    }
    assert own == {"fednova", "fedbn", "mocha", "fedap"}
