"""pFedLA against a hand-written float64 reference on ragged clients: each sampled client receives
the layer-wise aggregate of every client's model with weights from its own hypernetwork, and the
server pulls the client's update back through that aggregate (autograd here) into an SGD step on
the client's hypernetwork and embedding, and moves the client's stored model."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from test_baselines import assert_close, descend, logits, steps_of
from test_fast_sim import ragged_experiment
from test_pfedsim import assert_backends_agree, assert_evaluation, loss

from pflego.errors import ConfigError
from pflego.sim import Simulation

MODEL = ("body.1.weight", "body.1.bias", "head.weight", "head.bias")
OPTIONS = {"hn_lr": 0.5, "hn_momentum": 0.5, "embedding_dim": 5, "hidden_dim": 8}


def weights(phi: dict, i: int, count: int) -> dict:
    """alpha^l / sum alpha^l over the clients for every entry l, the MLP written out."""
    f = phi["embedding"] @ phi["la.in.weight"].T + phi["la.in.bias"]
    for j in range(2):
        f = torch.relu(f) @ phi[f"la.hidden.{j}.weight"].T + phi[f"la.hidden.{j}.bias"]
    f = torch.relu(f)
    out = {}
    for k in MODEL:
        alpha = torch.relu(f @ phi[f"la.out.{k}.weight"].T + phi[f"la.out.{k}.bias"])
        if float(alpha.detach().sum()) == 0:
            alpha = torch.nn.functional.one_hot(torch.tensor(i), count).to(alpha)
        out[k] = alpha / alpha.sum()
    return out


def aggregate(phi: dict, models: list[dict], i: int) -> dict:
    a = weights(phi, i, len(models))
    return {k: sum(a[k][j] * m[k] for j, m in enumerate(models)) for k in MODEL}


@pytest.mark.parametrize(
    "setting",
    [{"inner_steps": 3}, {"batch_size": 4, "local_epochs": 1.0}],
    ids=["full-batch", "minibatch"],
)
def test_pfedla_rounds_equal_the_papers_updates(setting):
    sim = Simulation(ragged_experiment("pfedla", options=OPTIONS, **setting), None)
    count = sim.exp.data.num_clients
    models_0, hyper_0, _ = sim.algorithm.tables(sim.server, sim.context(0))
    models = [{k: v[i].clone() for k, v in models_0.items()} for i in range(count)]
    phis = [{k: v[i].clone() for k, v in hyper_0.items()} for i in range(count)]
    for k in MODEL:  # FL-bench's initialization of the output layers, the same for everyone
        assert 0 <= float(phis[0][f"la.out.{k}.weight"].min()) < 1
        assert float(phis[0][f"la.out.{k}.bias"].abs().max()) == 0
    assert torch.equal(phis[0]["la.in.weight"], phis[5]["la.in.weight"])
    assert not torch.equal(phis[0]["embedding"], phis[5]["embedding"])
    buffers = [{k: torch.zeros_like(v) for k, v in phi.items()} for phi in phis]
    for t in range(4):
        ctx, cohort = sim.context(t), [int(i) for i in sim.cohort(t)]
        inputs = sim.round_inputs(t, cohort)
        sent = sim.downlink(ctx, torch.as_tensor(cohort))
        updates = {}
        for c, i in enumerate(cohort):
            bar = aggregate(phis[i], models, i)
            assert_close({k: v[c] for k, v in sent.items()}, bar)
            trained = descend(bar, MODEL, loss, steps_of(inputs.client(c)), lr=ctx.client_lr)
            delta = {k: bar[k] - trained[k] for k in MODEL}
            leaves = {k: v.clone().requires_grad_(True) for k, v in phis[i].items()}
            pulled = aggregate(leaves, models, i)
            inner = sum((pulled[k] * delta[k]).sum() for k in MODEL)
            grads = dict(zip(leaves, torch.autograd.grad(inner, list(leaves.values()))))
            buffers[i] = {k: OPTIONS["hn_momentum"] * buffers[i][k] + grads[k] for k in grads}
            updates[i] = (delta, {k: phis[i][k] - OPTIONS["hn_lr"] * buffers[i][k] for k in grads})
        sim.run_round(t)
        for i, (delta, phi) in updates.items():
            models[i] = {k: models[i][k] - delta[k] for k in MODEL}
            phis[i] = phi
        for i in range(count):
            params = sim.server["params"]
            assert_close({k: params["model." + k][i] for k in MODEL}, models[i])
            assert_close({k: params[k][i] for k in phis[i]}, phis[i])
    moved = max(
        float((phis[i]["embedding"] - hyper_0["embedding"][i]).abs().max()) for i in updates
    )
    assert moved > 1e-6  # the hypernetworks learned
    # Every client is evaluated with its aggregate theta-bar_i.
    assert_evaluation(sim, 4, [aggregate(phis[i], models, i) for i in range(count)])


def test_a_newcomer_is_evaluated_with_the_mean_of_the_clients_models():
    sim = Simulation(ragged_experiment("pfedla", unseen_fraction=0.34, options=OPTIONS), None)
    for t in range(2):
        sim.run_round(t)
    ctx = sim.context(2)
    payload = sim.algorithm.evaluation_downlink(sim.server, ctx)
    mean = {k: sim.server["params"]["model." + k].mean(0) for k in MODEL}
    assert_close(payload, mean)
    data = sim.personalization(2, unseen=True).inputs(np.array([0]))
    one = torch.utils._pytree.tree_map(lambda t: t[0], data)
    state = sim.init_state(6, payload, ctx)
    joined = sim.algorithm.join(payload, state, one, ctx)
    predicted = sim.algorithm.predict(payload, joined, one.x)
    torch.testing.assert_close(predicted, logits(mean, one.x), rtol=1e-10, atol=1e-12)


def test_the_backends_agree():
    assert_backends_agree("pfedla", OPTIONS, batch_size=4, local_epochs=1.0)


@pytest.mark.parametrize(
    "options", [{"hn_lr": 0.0}, {"hn_momentum": 1.0}, {"embedding_dim": 0}, {"hidden_dim": 0}]
)
def test_bad_options_are_one_line_errors(options):
    with pytest.raises(ConfigError):
        ragged_experiment("pfedla", options=options)
