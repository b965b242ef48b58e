"""FedGen against a hand-written float64 reference on ragged clients: the round's bank of generated
features, the clients' local steps on cross-entropy plus the KL to the generated features' logits
and the generated samples' cross-entropy (from the second round), FedAvg, the server's generator
steps on the clients' heads weighted by their label shares, and the global model's predictions."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from test_baselines import BODY, HEAD, assert_close, averaged, descend, logits, split, steps_of
from test_fast_sim import ragged_experiment

from pflego.errors import ConfigError
from pflego.rng import seed_for
from pflego.sim import Simulation

C, NOISE, HIDDEN, BANK = 4, 3, 5, 3
ALPHA, BETA, DECAY, GLR, STEPS, MIN = 0.7, 0.5, 0.9, 0.05, 2, 0.5
OPTIONS = {
    "alpha": ALPHA,
    "beta": BETA,
    "decay": DECAY,
    "generator_lr": GLR,
    "generator_steps": STEPS,
    "noise_dim": NOISE,
    "hidden_dim": HIDDEN,
    "bank_size": BANK,
    "min_samples": MIN,
}


def generate(w: dict, z: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """G(z, y) = W2 relu(W1 [z, onehot y] + b1) + b2."""
    h = torch.cat([z, F.one_hot(y, C).double()], -1)
    h = torch.relu(h @ w["generator.0.weight"].T + w["generator.0.bias"])
    return h @ w["generator.1.weight"].T + w["generator.1.bias"]


def head(p: dict, f: torch.Tensor) -> torch.Tensor:
    return f @ p["head.weight"].T + p["head.bias"]


def bank(w: dict, seed: int, t: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed_for(seed, 24, t))
    z = torch.randn((C, BANK, NOISE), generator=gen).double()
    return torch.stack([generate(w, z[c], torch.full((BANK,), c)) for c in range(C)])


def local_loss(generated: torch.Tensor, own: list[int], t: int):
    alpha, beta = max(1e-4, ALPHA * DECAY**t), max(1e-4, BETA * DECAY**t)

    def loss(p, x, y):
        out = logits(p, x)
        ce = F.cross_entropy(out, y)
        if t == 0:
            return ce
        kl = 0
        for s in range(len(y)):
            teacher = F.softmax(head(p, generated[int(y[s]), s % BANK]).detach(), -1)
            kl = kl + (teacher * (teacher.log() - F.log_softmax(out[s], -1))).sum()
        gen_ce = sum(
            F.cross_entropy(head(p, generated[c]), torch.full((BANK,), c)) for c in own
        ) / len(own)
        return ce + beta * kl / len(y) + alpha * gen_ce

    return loss


def adam(w, grad, m, v, step, lr):
    out = {}
    for k in w:
        m[k] = 0.9 * m[k] + 0.1 * grad[k]
        v[k] = 0.999 * v[k] + 0.001 * grad[k] ** 2
        out[k] = w[k] - lr * (m[k] / (1 - 0.9**step)) / ((v[k] / (1 - 0.999**step)).sqrt() + 1e-8)
    return out


def train_generator(w, m, v, heads, counts, seed, t):
    total = counts.sum(0)
    labels = (total / len(counts) > MIN).double()
    step = 0
    for j in range(STEPS):
        gen = torch.Generator().manual_seed(seed_for(seed, 25, t, j))
        y = torch.multinomial(labels, BANK, True, generator=gen)
        z = torch.randn((BANK, NOISE), generator=gen).double()
        leaves = {k: x.clone().requires_grad_() for k, x in w.items()}
        f = generate(leaves, z, y)
        loss = 0
        for h, n in zip(heads, counts, strict=True):
            for s in range(BANK):
                share = n[y[s]] / total[y[s]]
                loss = loss + share * F.cross_entropy(head(h, f[s : s + 1]), y[s : s + 1]) / BANK
        grads = dict(zip(leaves, torch.autograd.grad(loss, list(leaves.values())), strict=True))
        step = int(m["step"]) + 1
        m["step"] += 1
        w = adam(w, grads, m, v, step, GLR * 0.98**t)
    return w


@pytest.mark.parametrize(
    "setting", [{"inner_steps": 3}, {"batch_size": 4, "local_epochs": 1.5}], ids=["full", "mini"]
)
def test_fedgen_rounds_equal_the_papers_updates(setting):
    sim = Simulation(ragged_experiment("fedgen", options=OPTIONS, **setting), None)
    seed = sim.context(0).seed
    w, _ = sim.algorithm.generator_state(sim.server, sim.context(0))  # w_0: an input
    w = {k: x.clone() for k, x in w.items()}
    m = {k: torch.zeros_like(x) for k, x in w.items()} | {"step": torch.zeros(())}
    v = {k: torch.zeros_like(x) for k, x in w.items()}
    params = {k: x.clone() for k, x in sim.server["params"].items()}
    for t in range(3):
        ctx, cohort = sim.context(t), [int(i) for i in sim.cohort(t)]
        inputs = sim.round_inputs(t, cohort)
        generated = bank(w, seed, t)
        sent = sim.algorithm.downlink(sim.server, ctx)
        torch.testing.assert_close(sent["generated"], generated, rtol=1e-9, atol=1e-11)
        trained, clients, counts = [], [], []
        for c in range(len(cohort)):
            data = inputs.client(c)
            y = data.y[data.mask > 0]
            own = sorted(set(y.tolist()))
            counts.append(torch.bincount(y, minlength=C).double())
            loss = local_loss(generated, own, t)
            trained.append(descend(params, BODY + HEAD, loss, steps_of(data), lr=ctx.client_lr))
            clients.append(data)
        heads = [{k: p[k] for k in HEAD} for p in trained]
        w = train_generator(w, m, v, heads, torch.stack(counts), seed, t)
        params = averaged(params, trained, clients)
        sim.run_round(t)
        assert_close(sim.server["params"], params)
        assert_close(sim.server["generator"], w)
    # every client, seen or not, predicts with the global model
    accuracies = []
    for i in range(sim.exp.data.num_clients):
        x, y = split(sim, i, "test")
        accuracies.append(float((logits(params, x).argmax(1) == y).double().mean()))
    assert sim.evaluate(3)["test_acc"] == pytest.approx(np.mean(accuracies), abs=1e-12)


@pytest.mark.parametrize("options", [{"alpha": -1.0}, {"decay": 0.0}, {"bank_size": 0}])
def test_bad_options_are_one_line_errors(options):
    with pytest.raises(ConfigError, match="fedgen"):
        ragged_experiment("fedgen", options=options)
