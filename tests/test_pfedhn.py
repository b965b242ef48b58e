"""pFedHN against a hand-written float64 reference on ragged clients: the personal models the
hypernetwork generates, the clients' local steps and uploads, the server's chain-rule step on the
hypernetwork and the embeddings (momentum, weight decay, clipping), the evaluation of h(v_i; phi),
and a newcomer learning only its embedding."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from test_baselines import assert_close, descend, logits, split, steps_of
from test_fast_sim import ragged_experiment

from pflego.errors import ConfigError
from pflego.sim import Simulation

MODEL = ("body.1.weight", "body.1.bias", "head.weight", "head.bias")
HIDDEN, LAYERS, EMBED = 8, 2, 3
LR, MOMENTUM, DECAY = 0.5, 0.9, 0.01
OPTIONS = {
    "hidden_dim": HIDDEN,
    "hidden_layers": LAYERS,
    "embedding_dim": EMBED,
    "hyper_lr": LR,
    "hyper_momentum": MOMENTUM,
    "hyper_weight_decay": DECAY,
}


def generate(phi: dict, v: torch.Tensor, shapes: dict) -> dict:
    """h(v; phi): Linear -> (ReLU -> Linear) x LAYERS -> one linear head per target tensor."""
    f = v @ phi["hyper.in.weight"].T + phi["hyper.in.bias"]
    for j in range(LAYERS):
        f = torch.relu(f) @ phi[f"hyper.hidden.{j}.weight"].T + phi[f"hyper.hidden.{j}.bias"]
    return {
        k: (f @ phi[f"hyper.out.{k}.weight"].T + phi[f"hyper.out.{k}.bias"]).reshape(shape)
        for k, shape in shapes.items()
    }


def server_step(phi, table, momentum, pairs, clip):
    """One momentum-SGD step on the sum over the cohort of <h(v_i; phi), Delta_i> (autograd)."""
    leaves = {k: v.clone().requires_grad_() for k, v in {**phi, "embeddings": table}.items()}
    hyper = {k: v for k, v in leaves.items() if k != "embeddings"}
    surrogate = 0.0
    for i, delta in pairs:
        theta = generate(hyper, leaves["embeddings"][i], {k: delta[k].shape for k in MODEL})
        surrogate = surrogate + sum((theta[k] * delta[k]).sum() for k in MODEL)
    grads = dict(zip(leaves, torch.autograd.grad(surrogate, list(leaves.values())), strict=True))
    norm = math.sqrt(sum(float((g**2).sum()) for g in grads.values()))
    grads = {k: g * min(1.0, clip / (norm + 1e-6)) for k, g in grads.items()}
    new, buffers = {}, {}
    for k, g in grads.items():
        d = g + DECAY * leaves[k].detach()  # the authors' SGD decays the embeddings too
        buffers[k] = MOMENTUM * momentum[k] + d
        new[k] = leaves[k].detach() - LR * buffers[k]
    return new, buffers, norm


@pytest.mark.parametrize(
    "setting",
    [{"inner_steps": 3, "clip": math.inf}, {"batch_size": 4, "local_epochs": 1.5, "clip": 0.05}],
    ids=["full-batch", "minibatch-clipped"],
)
def test_pfedhn_rounds_equal_the_papers_updates(setting):
    setting = dict(setting)
    clip = setting.pop("clip")
    options = {**OPTIONS, "max_grad_norm": clip}
    sim = Simulation(
        ragged_experiment("pfedhn", participation=0.5, options=options, **setting), None
    )
    count = sim.exp.data.num_clients
    params, _ = sim.algorithm.hypernetwork(sim.server, sim.context(0))  # phi_0, v_0: inputs
    phi = {k: v.clone() for k, v in params.items() if k != "embeddings"}
    table = params["embeddings"].clone()
    assert table.shape == (count, EMBED) and len(phi) == 2 * (LAYERS + 1 + len(MODEL))
    weight = phi["hyper.in.weight"]
    assert weight.abs().max() <= 1 / math.sqrt(EMBED) and weight.std() > 0.1  # nn.Linear's init
    shapes = {k: v.shape for k, v in sim.algorithm.init_params(0).items()}
    momentum = {k: torch.zeros_like(v) for k, v in {**phi, "embeddings": table}.items()}
    norms = []
    for t in range(2):  # the second round carries the first one's momentum
        ctx, cohort = sim.context(t), sim.cohort(t)
        inputs = sim.round_inputs(t, cohort)
        sent = sim.downlink(ctx, cohort)
        pairs = []
        for c, i in enumerate(int(i) for i in cohort):
            theta = generate(phi, table[i], shapes)
            assert_close({k: v[c] for k, v in sent.items()}, theta)
            data = inputs.client(c)
            loss = lambda p, x, y: F.cross_entropy(logits(p, x), y)  # noqa: E731
            trained = descend(theta, MODEL, loss, steps_of(data), lr=ctx.client_lr)
            delta = {k: theta[k] - trained[k] for k in MODEL}
            if c == 0:  # the client's own upload: theta_i - theta~_i
                out, _ = sim.algorithm.client_update(
                    {k: v[c] for k, v in sent.items()}, sim.store.get(i), data, ctx
                )
                assert_close(out.upload, delta)
            pairs.append((i, delta))
        sim.run_round(t)
        new, momentum, norm = server_step(phi, table, momentum, pairs, clip)
        norms.append(norm)
        phi = {k: v for k, v in new.items() if k != "embeddings"}
        table = new["embeddings"]
        assert_close(sim.server["params"], new)
        assert_close(sim.server["momentum"], momentum)
        for i in range(count):
            theta = generate(phi, table[i], shapes)
            assert_close({k: v[i] for k, v in sim.server["models"].items()}, theta)
    if clip < math.inf:
        assert min(norms) > clip  # the clipping acted
    unsampled = sorted(set(range(count)) - {int(i) for i in sim.cohort(1)})
    assert not torch.equal(table[unsampled], params["embeddings"][unsampled])  # momentum moved them
    # evaluation: each client's generated model, without local steps
    accuracies = []
    for i in range(count):
        x, y = split(sim, i, "test")
        out = logits(generate(phi, table[i], shapes), x)
        accuracies.append(float((out.argmax(1) == y).double().mean()))
    assert sim.evaluate(2)["test_acc"] == pytest.approx(np.mean(accuracies), abs=1e-12)


def test_a_newcomer_learns_only_its_embedding_with_phi_frozen():
    sim = Simulation(ragged_experiment("pfedhn", unseen_fraction=0.34, options=OPTIONS), None)
    for t in range(2):
        sim.run_round(t)
    ctx = sim.context(2)
    payload = sim.algorithm.downlink(sim.server, ctx)
    torch.testing.assert_close(payload["embedding"], sim.server["params"]["embeddings"].mean(0))
    phi = {k: v for k, v in payload.items() if k.startswith("hyper.")}
    assert phi.keys() == {k for k in sim.server["params"] if k != "embeddings"}
    data = sim.personalization(2, unseen=True).inputs(np.array([0]))
    one = torch.utils._pytree.tree_map(lambda t: t[0], data)
    first = sim.init_state(6, payload, ctx)
    joined = sim.algorithm.join(payload, first, one, ctx)
    shapes = {k: v.shape for k, v in sim.algorithm.init_params(0).items()}

    def loss(p, x, y):
        theta = generate(phi, payload["embedding"] + p["shift"], shapes)
        return F.cross_entropy(logits(theta, x), y)

    start = {"shift": torch.zeros(EMBED, dtype=torch.float64)}
    expected = descend(start, ["shift"], loss, steps_of(one), lr=ctx.client_lr)
    torch.testing.assert_close(joined["embedding_shift"], expected["shift"], rtol=1e-9, atol=1e-11)
    assert float(expected["shift"].abs().sum()) > 0
    x = torch.randn(5, 1, 3, 3, dtype=torch.float64)
    theta = generate(phi, payload["embedding"] + expected["shift"], shapes)
    torch.testing.assert_close(sim.algorithm.predict(payload, joined, x), logits(theta, x))


@pytest.mark.parametrize(
    "options",
    [
        {"hyper_lr": 0.0},
        {"hyper_momentum": 1.0},
        {"hyper_weight_decay": -1.0},
        {"hidden_dim": 0},
        {"embedding_dim": 0},
        {"max_grad_norm": 0.0},
    ],
)
def test_bad_options_are_one_line_errors(options):
    with pytest.raises(ConfigError, match="pfedhn"):
        ragged_experiment("pfedhn", options=options)
