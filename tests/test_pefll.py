"""PeFLL against a hand-written float64 reference on ragged clients: each client's descriptor from
the embedding network, the model the hypernetwork generates from it, the local steps, the chain
rule back through both networks, the server's clipped Adam step on the mean gradient, and the
evaluation (and a newcomer's model) from one forward pass of both networks."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from test_baselines import descend, logits, split, steps_of
from test_fast_sim import ragged_experiment

from pflego.errors import ConfigError
from pflego.sim import Simulation

MODEL = ("body.1.weight", "body.1.bias", "head.weight", "head.bias")
C, HIDDEN, LAYERS, WIDTH, EMBED, LR = 4, 8, 2, 5, 3, 0.05
OPTIONS = {
    "hidden_dim": HIDDEN,
    "hidden_layers": LAYERS,
    "embed_hidden": WIDTH,
    "embedding_dim": EMBED,
    "hyper_lr": LR,
}


def descriptor(net: dict, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """v = mean over the samples of MLP(flatten(x) ++ onehot(y))."""
    h = torch.cat([x.flatten(1), F.one_hot(y, C).double()], 1)
    h = torch.relu(h @ net["embed.0.weight"].T + net["embed.0.bias"])
    h = torch.relu(h @ net["embed.1.weight"].T + net["embed.1.bias"])
    return (h @ net["embed.2.weight"].T + net["embed.2.bias"]).mean(0)


def generate(net: dict, v: torch.Tensor, shapes: dict) -> dict:
    """h(v): Linear -> (ReLU -> Linear) x LAYERS -> one linear head per target tensor."""
    f = v @ net["hyper.in.weight"].T + net["hyper.in.bias"]
    for j in range(LAYERS):
        f = torch.relu(f) @ net[f"hyper.hidden.{j}.weight"].T + net[f"hyper.hidden.{j}.bias"]
    return {
        k: (f @ net[f"hyper.out.{k}.weight"].T + net[f"hyper.out.{k}.bias"]).reshape(s)
        for k, s in shapes.items()
    }


def adam(net: dict, grad: dict, m: dict, v: dict, step: int) -> dict:
    """torch.optim.Adam's step (betas 0.9, 0.999; eps 1e-8), written out."""
    out = {}
    for k in net:
        m[k] = 0.9 * m[k] + 0.1 * grad[k]
        v[k] = 0.999 * v[k] + 0.001 * grad[k] ** 2
        denom = (v[k] / (1 - 0.999**step)).sqrt() + 1e-8
        out[k] = net[k] - LR * (m[k] / (1 - 0.9**step)) / denom
    return out


@pytest.mark.parametrize(
    "setting",
    [{"inner_steps": 3, "clip": math.inf}, {"batch_size": 4, "local_epochs": 1.5, "clip": 0.02}],
    ids=["full-batch", "minibatch-clipped"],
)
def test_pefll_rounds_equal_the_papers_updates(setting):
    setting = dict(setting)
    clip = setting.pop("clip")
    options = {**OPTIONS, "max_grad_norm": clip}
    sim = Simulation(
        ragged_experiment("pefll", participation=0.5, options=options, **setting), None
    )
    count = sim.exp.data.num_clients
    net = {k: v.clone() for k, v in sim.algorithm.downlink(sim.server, sim.context(0)).items()}
    assert net["embed.0.weight"].shape == (WIDTH, 9 + C) and net["embed.2.weight"].shape[0] == EMBED
    assert net["embed.0.weight"].abs().max() <= 1 / math.sqrt(9 + C)  # nn.Linear's init
    shapes = {k: v.shape for k, v in sim.algorithm.init_params(0).items()}
    m = {k: torch.zeros_like(v) for k, v in net.items()}
    second = {k: torch.zeros_like(v) for k, v in net.items()}
    norms = []
    for t in range(3):  # later rounds carry Adam's moments
        ctx, cohort = sim.context(t), [int(i) for i in sim.cohort(t)]
        inputs = sim.round_inputs(t, cohort)
        grads, embeddings = [], {}
        for c, i in enumerate(cohort):
            leaves = {k: v.clone().requires_grad_() for k, v in net.items()}
            v = descriptor(leaves, *split(sim, i, "train"))
            theta = generate(leaves, v, shapes)
            start = {k: w.detach() for k, w in theta.items()}
            loss = lambda p, x, y: F.cross_entropy(logits(p, x), y)  # noqa: E731
            trained = descend(start, MODEL, loss, steps_of(inputs.client(c)), lr=ctx.client_lr)
            delta = [start[k] - trained[k] for k in MODEL]
            pulled = torch.autograd.grad([theta[k] for k in MODEL], list(leaves.values()), delta)
            grads.append(dict(zip(leaves, pulled, strict=True)))
            embeddings[i] = v.detach()
        mean = {k: sum(g[k] for g in grads) / len(grads) for k in net}
        norm = math.sqrt(sum(float((g**2).sum()) for g in mean.values()))
        norms.append(norm)
        mean = {k: g * min(1.0, clip / (norm + 1e-6)) for k, g in mean.items()}
        net = adam(net, mean, m, second, t + 1)
        sim.run_round(t)
        for k in net:
            torch.testing.assert_close(sim.server["params"][k], net[k], rtol=1e-8, atol=1e-10)
        for i, v in embeddings.items():  # the descriptor each client trained with
            torch.testing.assert_close(sim.store.get(i)["embedding"], v, rtol=1e-9, atol=1e-11)
    if clip < math.inf:
        assert min(norms) > clip  # the clipping acted
    # evaluation: every client's model from its descriptor under the current networks
    accuracies = []
    for i in range(count):
        theta = generate(net, descriptor(net, *split(sim, i, "train")), shapes)
        x, y = split(sim, i, "test")
        accuracies.append(float((logits(theta, x).argmax(1) == y).double().mean()))
    assert sim.evaluate(3)["test_acc"] == pytest.approx(np.mean(accuracies), abs=1e-12)


def test_a_newcomer_gets_its_model_from_its_descriptor_without_local_steps():
    sim = Simulation(ragged_experiment("pefll", unseen_fraction=0.34, options=OPTIONS), None)
    for t in range(2):
        sim.run_round(t)
    ctx = sim.context(2)
    payload = sim.algorithm.downlink(sim.server, ctx)
    assert payload.keys() == sim.server["params"].keys()
    shapes = {k: v.shape for k, v in sim.algorithm.init_params(0).items()}
    data = sim.personalization(2, unseen=True).inputs(np.array([0]))
    one = torch.utils._pytree.tree_map(lambda t: t[0], data)
    real = one.mask > 0
    joined = sim.algorithm.join(payload, sim.init_state(4, payload, ctx), one, ctx)
    v = descriptor(payload, one.x[real], one.y[real])
    torch.testing.assert_close(joined["embedding"], v, rtol=1e-9, atol=1e-11)
    x = torch.randn(5, 1, 3, 3, dtype=torch.float64)
    expected = logits(generate(payload, v, shapes), x)
    torch.testing.assert_close(sim.algorithm.predict(payload, joined, x), expected)


@pytest.mark.parametrize(
    "options",
    [{"hyper_lr": 0.0}, {"hidden_dim": 0}, {"embed_hidden": 0}, {"embedding_dim": 0}],
)
def test_bad_options_are_one_line_errors(options):
    with pytest.raises(ConfigError, match="pefll"):
        ragged_experiment("pefll", options=options)
