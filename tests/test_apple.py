"""APPLE against a hand-written float64 reference on ragged clients, trained as the authors' code
trains its ``ClientNet``: torch.optim.SGD over the client's own core model and its DR vector p
(its own step size), every other core fixed, the personalized model sum_j p_j w_j, and the
proximal term on p weighted by the loss scheduler."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from test_baselines import assert_close, logits, split, steps_of
from test_fast_sim import ragged_experiment

from pflego.errors import ConfigError
from pflego.sim import Simulation

MODEL = ("body.1.weight", "body.1.bias", "head.weight", "head.bias")
MU, DR_LR, HORIZON, FRACTION = 0.5, 0.05, 10, 0.3  # L = 3 rounds of proximal term


def scheduled(kind: str, r: int) -> float:
    """lambda(r) mu of the authors' ``get_reg_coef``."""
    rounds = int(HORIZON * FRACTION)
    if r >= rounds:
        return 0.0
    if kind == "cosine":
        return (np.cos(np.pi / rounds * r) + 1) / 2 * MU
    return (0.001 / 1) ** (r / rounds) * MU


def apple_round(cores, i, p, data, lr, momentum, coef, train_core=True):
    """One client's round: SGD (momentum as torch's) on its own core and p, others fixed."""
    count = len(cores)
    core = {k: v.clone().requires_grad_(True) for k, v in cores[i].items()} if train_core else {}
    p = p.clone().requires_grad_(True)
    p0 = torch.full((count,), 1 / count, dtype=torch.float64)
    groups = [{"params": [p], "lr": DR_LR}] + ([{"params": list(core.values())}] if core else [])
    optimizer = torch.optim.SGD(groups, lr=lr, momentum=momentum)
    for x, y in steps_of(data):
        if len(y) == 0:
            continue
        personal = {
            k: sum(p[j] * (core[k] if core and j == i else cores[j][k]) for j in range(count))
            for k in MODEL
        }
        loss = F.cross_entropy(logits(personal, x), y) + coef * ((p - p0) ** 2).sum()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return {k: v.detach() for k, v in core.items()}, p.detach()


@pytest.mark.parametrize(
    ("scheduler", "setting"),
    [
        ("exponential", {"batch_size": 4, "local_epochs": 1.0, "client_optimizer": "momentum"}),
        ("cosine", {"inner_steps": 3}),
    ],
    ids=["exponential-minibatch-momentum", "cosine-full-batch-sgd"],
)
def test_apple_rounds_equal_the_authors_client_training(scheduler, setting):
    options = {
        "mu": MU,
        "dr_lr": DR_LR,
        "horizon": HORIZON,
        "reg_fraction": FRACTION,
        "scheduler": scheduler,
    }
    sim = Simulation(ragged_experiment("apple", options=options, **setting), None)
    momentum = 0.9 if setting.get("client_optimizer") == "momentum" else 0.0
    count = sim.exp.data.num_clients
    cores = [{k: v.clone() for k, v in sim.server["params"].items()} for _ in range(count)]
    ps = [torch.full((count,), 1 / count, dtype=torch.float64) for _ in range(count)]
    for t in range(4):
        ctx, cohort = sim.context(t), sim.cohort(t)
        inputs = sim.round_inputs(t, cohort)
        table = [dict(c) for c in cores]  # the cores every client of this round downloads
        for c, i in enumerate(int(i) for i in cohort):
            coef = scheduled(scheduler, t)
            cores[i], ps[i] = apple_round(
                table, i, ps[i], inputs.client(c), ctx.client_lr, momentum, coef
            )
        sim.run_round(t)
        for i in range(count):
            assert_close({k: v[i] for k, v in sim.server["cores"].items()}, cores[i])
        for i in map(int, cohort):
            torch.testing.assert_close(sim.store.get(i)["p"], ps[i], rtol=1e-9, atol=1e-11)
    assert scheduled(scheduler, 1) > 0 and scheduled(scheduler, 3) == 0  # the term fades out
    moved = max(float((p - 1 / count).abs().max()) for p in ps)
    assert moved > 1e-3  # the DR vectors were learned
    accuracies = []
    for i in range(count):
        personal = {k: sum(ps[i][j] * cores[j][k] for j in range(count)) for k in MODEL}
        x, y = split(sim, i, "test")
        accuracies.append(float((logits(personal, x).argmax(1) == y).double().mean()))
    assert sim.evaluate(4)["test_acc"] == pytest.approx(np.mean(accuracies), abs=1e-12)


def test_a_newcomer_learns_only_its_dr_vector_over_the_trained_cores():
    options = {"mu": MU, "dr_lr": DR_LR, "horizon": HORIZON, "reg_fraction": FRACTION}
    sim = Simulation(ragged_experiment("apple", unseen_fraction=0.34, options=options), None)
    for t in range(2):
        sim.run_round(t)
    ctx = sim.context(2)
    payload = sim.algorithm.downlink(sim.server, ctx)
    assert payload["own"].abs().sum() == 0
    count = sim.exp.data.num_clients
    data = sim.personalization(2, unseen=True).inputs(np.array([0]))
    one = torch.utils._pytree.tree_map(lambda t: t[0], data)
    joined = sim.algorithm.join(payload, sim.init_state(count, payload, ctx), one, ctx)
    cores = [{k: v[j] for k, v in sim.server["cores"].items()} for j in range(count)]
    # A client outside the cores' table: index -1 is none of them, so every core stays fixed.
    _, p = apple_round(
        cores, -1, torch.full((count,), 1 / count, dtype=torch.float64), one,
        ctx.client_lr, 0.0, scheduled("exponential", 2), train_core=False,
    )  # fmt: skip
    torch.testing.assert_close(joined["p"], p, rtol=1e-9, atol=1e-11)
    assert not torch.allclose(p, torch.full_like(p, 1 / count))


def test_the_schedules_follow_the_authors_loss_scheduler():
    for kind in ("exponential", "cosine"):
        alg = Simulation(
            ragged_experiment(
                "apple",
                options={"mu": MU, "horizon": HORIZON, "reg_fraction": FRACTION, "scheduler": kind},
            ),
            None,
        ).algorithm
        for r in range(6):
            assert alg.proximal_weight(r) == pytest.approx(scheduled(kind, r), rel=1e-12)
    assert math.isclose(scheduled("cosine", 0), MU)


@pytest.mark.parametrize(
    "options",
    [{"scheduler": "linear"}, {"dr_lr": -1.0}, {"mu": -0.1}, {"reg_fraction": 2.0}, {"horizon": 0}],
)
def test_bad_options_are_one_line_errors(options):
    with pytest.raises(ConfigError):
        ragged_experiment("apple", options=options)


def initial_cores(seed: int, own_init: bool, backend: str = "vmap") -> list[dict]:
    sim = Simulation(
        ragged_experiment("apple", seed=seed, backend=backend, options={"own_init": own_init}),
        None,
    )
    ctx = sim.context(0)
    cores = sim.algorithm.cores(sim.server, ctx)
    return [{k: v[j] for k, v in cores.items()} for j in range(ctx.num_clients)]


def test_own_init_draws_each_clients_core_from_the_seed_and_its_id():
    """The authors' per-client initializations differ between clients and follow the run's seed;
    without ``own_init`` every core is the run's one initial model."""
    shared, own = initial_cores(0, False), initial_cores(0, True)
    for core in shared[1:]:
        assert_close(core, shared[0])
    for i, a in enumerate(own):
        for b in own[i + 1 :]:
            assert not torch.equal(a["head.weight"], b["head.weight"])
            assert not torch.equal(a["body.1.weight"], b["body.1.weight"])
    for a, b in zip(own, initial_cores(0, True, backend="loop"), strict=True):
        assert_close(a, b)  # no global RNG: the same draw again
    assert not torch.equal(initial_cores(1, True)[0]["head.weight"], own[0]["head.weight"])


@pytest.mark.parametrize("setting", [{"inner_steps": 3}, {"batch_size": 4, "local_epochs": 1.0}])
def test_own_init_rounds_equal_the_authors_training_from_the_clients_own_cores(setting):
    options = {"own_init": True, "dr_lr": DR_LR}  # the reference steps p with DR_LR
    sim = Simulation(ragged_experiment("apple", options=options, **setting), None)
    cores = initial_cores(0, True)
    count = len(cores)
    ps = [torch.full((count,), 1 / count, dtype=torch.float64) for _ in range(count)]
    for t in range(2):
        ctx, cohort = sim.context(t), sim.cohort(t)
        inputs = sim.round_inputs(t, cohort)
        table = [dict(c) for c in cores]
        coef = 0.1 * 0.001 ** (t / 16)  # the defaults: mu 0.1, L = 16 rounds
        for c, i in enumerate(int(i) for i in cohort):
            cores[i], ps[i] = apple_round(table, i, ps[i], inputs.client(c), ctx.client_lr, 0, coef)
        sim.run_round(t)
        for i in range(count):
            assert_close({k: v[i] for k, v in sim.server["cores"].items()}, cores[i])
