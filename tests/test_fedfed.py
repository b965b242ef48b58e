"""FedFed against a hand-written float64 reference on ragged clients: the distillation rounds (the
model and the distiller on reconstruction, the noised sensitive part's and the input's
cross-entropy; each client's noised sensitive features kept in the server's table), then the
classification rounds (FedAvg on the minibatch's and the round's shared rows' cross-entropy), and
the global model's predictions for seen and unseen clients."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from test_baselines import assert_close, averaged, logits, split
from test_fast_sim import ragged_experiment

from pflego.errors import ConfigError
from pflego.rng import counter_normal, first_visit_generator, next_key, seed_for
from pflego.sim import Simulation

WARMUP, HIDDEN, SIGMA, RE, CE, XCE, SHARE, DRAW = 2, 5, 0.3, 1.5, 0.7, 0.4, 3, 4
OPTIONS = {
    "warmup_rounds": WARMUP,
    "hidden_dim": HIDDEN,
    "noise_std": SIGMA,
    "reconstruction": RE,
    "sensitive_ce": CE,
    "input_ce": XCE,
    "shared_samples": SHARE,
    "shared_batch": DRAW,
}


def robust(p: dict, x: torch.Tensor) -> torch.Tensor:
    """G(x) = W1 relu(W0 flat(x) + b0) + b1, one input at a time."""
    h = torch.relu(p["distiller.0.weight"] @ x.flatten() + p["distiller.0.bias"])
    return (p["distiller.1.weight"] @ h + p["distiller.1.bias"]).reshape(x.shape)


def eps(key: torch.Tensor, s: int, d: int, offset: int) -> torch.Tensor:
    """The client's standard normal draws of sample s, coordinates offset..offset+d-1."""
    return torch.stack(
        [counter_normal(key, torch.tensor(s), torch.tensor(offset + j)) for j in range(d)]
    )


def ce(p: dict, x: torch.Tensor, y: int) -> torch.Tensor:
    return F.cross_entropy(logits(p, x[None]), torch.tensor([y]))


def sgd(p: dict, loss, lr: float) -> dict:
    leaves = {k: v.clone().requires_grad_(True) for k, v in p.items()}
    grads = torch.autograd.grad(loss(leaves), list(leaves.values()), allow_unused=True)
    return {
        k: v.detach() if g is None else (v - lr * g).detach()
        for (k, v), g in zip(leaves.items(), grads, strict=True)
    }


def distill(p: dict, data, key: torch.Tensor, lr: float) -> dict:
    """Local steps on RE mse(G(x), x) + CE ce(x - G(x) + sigma eps) + XCE ce(x), batch means."""
    d = data.x[0].numel()
    for row, m in zip(data.batches, data.batch_mask, strict=True):
        idx = [int(s) for s in row[m > 0]]
        if not idx:
            continue

        def loss(q, idx=idx):
            total = 0
            for s in idx:
                x, y = data.x[s], int(data.y[s])
                r = robust(q, x)
                noised = x - r + SIGMA * eps(key, s, d, 0).reshape(x.shape)
                total = total + RE * ((r - x) ** 2).mean() + CE * ce(q, noised, y)
                total = total + XCE * ce(q, x, y)
            return total / len(idx)

        p = sgd(p, loss, lr)
    return p


def classify(p: dict, data, shared: list, lr: float) -> dict:
    """Local steps on the batch's mean CE plus the shared rows' mean CE."""
    for row, m in zip(data.batches, data.batch_mask, strict=True):
        idx = [int(s) for s in row[m > 0]]
        if not idx:
            continue

        def loss(q, idx=idx):
            own = sum(ce(q, data.x[s], int(data.y[s])) for s in idx) / len(idx)
            return own + sum(ce(q, x, y) for x, y in shared) / len(shared)

        p = sgd(p, loss, lr)
    return p


@pytest.mark.parametrize(
    "setting", [{"inner_steps": 3}, {"batch_size": 4, "local_epochs": 1.5}], ids=["full", "mini"]
)
def test_fedfed_rounds_equal_the_papers_updates(setting):
    sim = Simulation(ragged_experiment("fedfed", options=OPTIONS, **setting), None)
    seed, count = sim.context(0).seed, sim.exp.data.num_clients
    keys = {
        i: torch.randint(0, 2**24, (), generator=first_visit_generator(seed, i)).double()
        for i in range(count)
    }
    params = {k: x.clone() for k, x in sim.server["params"].items()}
    table = {}  # client -> [(noised sensitive features, label)]
    for t in range(WARMUP + 3):
        ctx, cohort = sim.context(t), [int(i) for i in sim.cohort(t)]
        inputs = sim.round_inputs(t, cohort)
        shared = []
        if t >= WARMUP:
            rows = [(i, s) for i in range(count) for s in range(SHARE)]
            weights = torch.tensor([float(s < len(table.get(i, []))) for i, s in rows])
            gen = torch.Generator().manual_seed(seed_for(seed, 42, t))
            drawn = torch.multinomial(weights, DRAW, True, generator=gen)
            shared = [table[rows[j][0]][rows[j][1]] for j in drawn.tolist()]
        trained, clients = [], []
        for c, i in enumerate(cohort):
            data = inputs.client(c)
            n = int(data.num_samples)
            if t < WARMUP:
                p = distill(params, data, keys[i], ctx.client_lr)
                d = data.x[0].numel()
                table[i] = [
                    (x - robust(p, x) + SIGMA * eps(keys[i], s, d, d).reshape(x.shape), int(y))
                    for s, (x, y) in enumerate(zip(data.x[: min(n, SHARE)], data.y, strict=False))
                ]
            else:
                p = classify(params, data, shared, ctx.client_lr)
            keys[i] = next_key(keys[i])
            trained.append(p)
            clients.append(data)
        params = averaged(params, trained, clients)
        sim.run_round(t)
        assert_close(sim.server["params"], params)
        for i in range(count):
            got = sim.server["shared"]["x"][i][sim.server["shared"]["mask"][i] > 0]
            want = [x for x, _ in table.get(i, [])]
            assert len(got) == len(want)
            for a, b in zip(got, want, strict=True):
                torch.testing.assert_close(a, b.detach(), rtol=1e-9, atol=1e-11)
    assert len(table) < count  # some client shared nothing (never sampled while distilling)
    # every client predicts with the global model
    accuracies = []
    for i in range(count):
        x, y = split(sim, i, "test")
        accuracies.append(float((logits(params, x).argmax(1) == y).double().mean()))
    assert sim.evaluate(WARMUP + 3)["test_acc"] == pytest.approx(np.mean(accuracies), abs=1e-12)


def test_the_backends_agree_in_both_phases():
    """The registry's backend test runs the default 15 distillation rounds only; here the
    classification rounds too."""
    sims = {
        b: Simulation(
            ragged_experiment(
                "fedfed", backend=b, batch_size=4, options=OPTIONS | {"warmup_rounds": 1}
            ),
            None,
        )
        for b in ("loop", "vmap", "fused")
    }
    for t in range(3):
        for sim in sims.values():
            sim.run_round(t)
    for b in ("vmap", "fused"):
        assert_close(sims[b].server["params"], sims["loop"].server["params"])
        assert_close(sims[b].server["shared"], sims["loop"].server["shared"])


def test_an_unseen_client_predicts_with_the_global_model():
    sim = Simulation(ragged_experiment("fedfed", unseen_fraction=0.34, options=OPTIONS), None)
    for t in range(WARMUP + 1):
        sim.run_round(t)
    ctx = sim.context(WARMUP + 1)
    payload = sim.algorithm.evaluation_downlink(sim.server, ctx)
    data = sim.personalization(WARMUP + 1, unseen=True).inputs(np.array([0]))
    one = torch.utils._pytree.tree_map(lambda t: t[0], data)
    state = sim.init_state(sim.exp.data.num_clients, payload, ctx)
    joined = sim.algorithm.join(payload, state, one, ctx)
    x = one.x[one.mask > 0]
    want = logits(sim.server["params"], x)
    torch.testing.assert_close(
        sim.algorithm.predict(payload, joined, x), want, rtol=1e-9, atol=1e-11
    )


@pytest.mark.parametrize(
    "options", [{"warmup_rounds": 0}, {"noise_std": -1.0}, {"shared_batch": 0}]
)
def test_bad_options_are_one_line_errors(options):
    with pytest.raises(ConfigError, match="fedfed"):
        ragged_experiment("fedfed", options=options)
