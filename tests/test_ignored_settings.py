"""Every run setting either changes what an algorithm computes or is refused in one line.

For each registered algorithm and each setting that a method may not use (``join_epochs``, the
server optimizer and step size, the client optimizer, step size and weight decay), the run with the
setting must differ from the run without it, or building the run must fail with a ``ConfigError``
that names the algorithm and the setting. The refusing methods are listed, so that a method that
starts or stops using a setting is noticed.
"""

from __future__ import annotations

import re

import pytest
import torch
from conftest import tiny_experiment

from pflego.algorithms import ALGORITHMS
from pflego.config import load_config
from pflego.errors import ConfigError
from pflego.sim import Simulation

NAMES = sorted(ALGORITHMS)

#: Methods whose new clients take no local steps that join_epochs could lengthen.
JOIN_REFUSED = {"fedavg", "fedprox", "feddyn", "cfl", "fedem", "d-fedem", "perfedavg"}
JOIN_REFUSED |= {"scaffold", "fednova", "fedlc", "moon", "fedcac", "knn-per"}
JOIN_REFUSED |= {"qffl", "fedadmm", "fedntd", "ifca", "elastic"}
JOIN_REFUSED |= {"fedcross", "pfedla"}
JOIN_REFUSED |= {"pefll", "fedgen"}
JOIN_REFUSED |= {"ccvr", "pfedfda"}
JOIN_REFUSED |= {"fedsr", "fediir", "floco"}  # global domain-generalization methods
JOIN_REFUSED |= {"fedfed"}
#: Methods whose server rule is their own (no server optimizer, no server_lr), and Clustered FL
#: and IFCA, which step by server_lr but with no other optimizer.
SERVER_LR_REFUSED = {
    "feddyn",
    "fedfomo",
    "fedmtl",
    "metafed",
    "mocha",
    "d-fedem",
    "local",
    "apple",
    "fedamp",
    "fedap",
    "fedcross",
    "fedproto",
    "pfedhn",
    "feddistill",
    "fedmd",
    "pfedla",
    "pfedsim",
    "pefll",
}
SERVER_LR_REFUSED |= {"fedpcl"}
SERVER_LR_REFUSED |= {"adcol"}  # its discriminator steps by dis_lr
SERVER_OPTIMIZER_REFUSED = SERVER_LR_REFUSED | {"cfl", "ifca"}
#: Per-FedAvg takes plain gradient steps; MOCHA its own SDCA steps (no optimizer, no decay).
CLIENT_OPTIMIZER_REFUSED = {"perfedavg", "mocha"}
WEIGHT_DECAY_REFUSED = {"mocha"}
#: MOCHA's SDCA has no step size either, but a client_lr given to every method is not refused.
CLIENT_LR_IGNORED = {"mocha"}

SERVER_SETTINGS = {"server_optimizer": "adam", "server_lr": 0.5}
CLIENT_SETTINGS = {
    "client_optimizer": "momentum",
    "client_optimizer=adam": "adam",
    "client_lr": 0.2,
    "weight_decay": 0.1,
}


def refused(name: str, setting: str) -> set[str]:
    return {
        "join_epochs": JOIN_REFUSED,
        "server_optimizer": SERVER_OPTIMIZER_REFUSED,
        "server_lr": SERVER_LR_REFUSED,
        "client_optimizer": CLIENT_OPTIMIZER_REFUSED,
        "client_lr": set(),
        "weight_decay": WEIGHT_DECAY_REFUSED,
    }[setting]


#: Methods whose first round trains nothing that is kept (FedDBE's round 0 only measures the
#: clients' feature mean), so settings show from the second round on.
ROUNDS = {"feddbe": 2}
ROUNDS |= {"fedpcl": 2}  # FedPCL's round 0 only computes prototypes (none exist to train on)
#: Methods whose settings show only on a model of their own (FedBN's new clients train their
#: batch-norm layers; a model without them makes FedBN FedAvg).
MODELS = {"fedbn": {"model": "mlp-bn"}}


def outcome(name: str, rounds: int | None = None, **settings) -> dict[str, torch.Tensor]:
    """The server's parameters and every client's state after ``rounds`` rounds (default: one,
    or :data:`ROUNDS`)."""
    rounds = rounds or ROUNDS.get(name, 1)
    sim = Simulation(tiny_experiment(algorithm=name, **MODELS.get(name, {}), **settings), None)
    for t in range(rounds):
        sim.run_round(t)
    return {
        **{f"server.{k}": v.clone() for k, v in sim.server["params"].items()},
        **{f"client.{k}": v.clone() for k, v in sim.store.tensors.items()},
    }


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("name", NAMES)
def test_join_epochs_acts_or_is_refused(name):
    if name in JOIN_REFUSED:
        with pytest.raises(ConfigError, match=rf"^{re.escape(name)}\b.*join_epochs=4"):
            tiny_experiment(algorithm=name, unseen_fraction=0.34, join_epochs=4)
        return
    losses = []
    for extra in ({}, {"join_epochs": 4}):
        extra |= MODELS.get(name, {})
        sim = Simulation(tiny_experiment(algorithm=name, unseen_fraction=0.34, **extra), None)
        sim.run_round(0)
        losses.append(sim.evaluate(1)["unseen_train_loss"])
    assert losses[0] != losses[1]


def test_join_epochs_without_clients_that_never_train_is_refused():
    with pytest.raises(ConfigError, match="join_epochs=4.0 .* unseen_fraction=0"):
        load_config({"join_epochs": 4})


@pytest.mark.parametrize("name", NAMES)
def test_server_settings_act_or_are_refused(name):
    plain = outcome(name)
    for key, value in SERVER_SETTINGS.items():
        if name in refused(name, key):
            with pytest.raises(ConfigError, match=rf"^{re.escape(name)}\b.*{key}={value}"):
                tiny_experiment(algorithm=name, **{key: value})
            continue
        changed = outcome(name, **{key: value})
        server = [k for k in plain if k.startswith("server.")]
        assert not all(torch.equal(plain[k], changed[k]) for k in server), key


@pytest.mark.parametrize("name", NAMES)
def test_client_settings_act_or_are_refused(name):
    plain = outcome(name)
    for label, value in CLIENT_SETTINGS.items():
        key = label.partition("=")[0]
        if name in refused(name, key):
            with pytest.raises(ConfigError, match=rf"^{re.escape(name)}\b.*{key}={value}"):
                tiny_experiment(algorithm=name, **{key: value})
            continue
        if not (key == "client_lr" and name in CLIENT_LR_IGNORED):
            assert not same(plain, outcome(name, **{key: value})), label


def test_a_refused_setting_at_its_default_value_is_accepted():
    """server_lr equal to the method's default (what an unset one resolves to) and sgd pass."""
    tiny_experiment(algorithm="feddyn", server_lr=1.0, server_optimizer="sgd")
    tiny_experiment(algorithm="mocha", client_optimizer="sgd", weight_decay=0.0)
    tiny_experiment(algorithm="perfedavg", client_optimizer="sgd", weight_decay=0.1)
