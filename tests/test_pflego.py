"""PFLEGO's defining properties (Algorithm 1 and Proposition 1 of the paper) as tests."""

from __future__ import annotations

import copy
import itertools

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from conftest import tiny_experiment
from torch import nn

from pflego import tree
from pflego.errors import ConfigError
from pflego.rng import minibatch_rng
from pflego.sim import Simulation
from pflego.sim.clients import client_schedules
from pflego.types import ClientData, Schedule

RHO = 0.3


def prepared(**overrides) -> Simulation:
    """A float64 PFLEGO simulation on clients of unequal sizes, every client already initialized."""
    settings = dict(
        algorithm="pflego", partition="dirichlet", alpha=0.5, server_lr=RHO, inner_steps=1
    )
    sim = Simulation(tiny_experiment(**{**settings, **overrides}), None)
    ctx = sim.context(0)
    down = sim.algorithm.downlink(sim.server, ctx)
    for i in range(sim.exp.data.num_clients):
        sim.store.scatter(
            np.array([i]), tree.map_(lambda v: v.unsqueeze(0), sim.client_state(i, down, ctx))
        )
    return sim


def snapshot(sim: Simulation) -> dict[str, torch.Tensor]:
    """theta and every W_i as one flat dict."""
    out = {k: v.clone() for k, v in sim.server["params"].items()}
    out.update({f"client.{k}": v.clone() for k, v in sim.store.tensors.items()})
    return out


def exact_gradient(sim: Simulation) -> dict[str, torch.Tensor]:
    """grad of L(psi) = sum_i alpha_i l_i over ALL clients, written independently with autograd."""
    data, model = sim.exp.data, sim.algorithm.model
    theta = {k: v.clone().requires_grad_(True) for k, v in sim.server["params"].items()}
    heads = {k: v.clone().requires_grad_(True) for k, v in sim.store.tensors.items()}
    loss = 0.0
    for i in range(data.num_clients):
        sl = data.train_slice(i)
        x, y = data.inputs(data.x_train[sl]).double(), data.y_train_local[sl]
        k_i = int((data.client_classes[i] >= 0).sum())
        logits = (
            model.features(theta, x) @ heads["head.weight"][i, :k_i].T + heads["head.bias"][i, :k_i]
        )
        loss = loss + (len(y) / data.total_train) * F.cross_entropy(logits, y)
    names = list(theta) + list(heads)
    grads = torch.autograd.grad(loss, [*theta.values(), *heads.values()])
    return {(n if n in theta else f"client.{n}"): g for n, g in zip(names, grads, strict=True)}


def stochastic_gradient(
    sim: Simulation, start: dict, cohort=None, t: int = 0
) -> dict[str, torch.Tensor]:
    """(psi_before - psi_after) / rho for one round, from a fixed starting point."""
    sim.server = copy.deepcopy(start["server"])
    sim.store.tensors = {k: v.clone() for k, v in start["store"].items()}
    before = snapshot(sim)
    if cohort is not None:
        sim.sampling.cohort = lambda _t: cohort
    sim.run_round(t)
    after = snapshot(sim)
    return {k: (before[k] - after[k]) / RHO for k in before}


def start_of(sim: Simulation) -> dict:
    return {
        "server": copy.deepcopy(sim.server),
        "store": {k: v.clone() for k, v in sim.store.tensors.items()},
    }


def test_full_participation_tau_one_is_one_full_batch_gradient_step():
    sim = prepared(participation=1.0)
    assert len(set(sim.exp.data.train_sizes.tolist())) > 1  # unequal alpha_i make the test sharp
    before, gradient = snapshot(sim), exact_gradient(sim)
    expected = {k: v - RHO * gradient[k] for k, v in before.items()}
    sim.run_round(0)
    for k, v in snapshot(sim).items():
        torch.testing.assert_close(v, expected[k], rtol=0, atol=1e-6)


@pytest.mark.parametrize("sampling", ["fixed", "bernoulli"])
def test_expectation_over_all_cohorts_is_the_exact_gradient(sampling):
    """Enumerating every cohort with its probability gives E[g] exactly (Proposition 1)."""
    sim = prepared(participation=0.5, sampling=sampling)
    start, exact = start_of(sim), exact_gradient(sim)
    num, p = sim.exp.data.num_clients, 0.5
    sizes = [3] if sampling == "fixed" else range(1, num + 1)  # the empty cohort contributes zero
    mean = tree.zeros_like(exact)
    for size in sizes:
        cohorts = list(itertools.combinations(range(num), size))
        for cohort in cohorts:
            weight = 1 / len(cohorts) if sampling == "fixed" else p**size * (1 - p) ** (num - size)
            mean = tree.axpy(weight, stochastic_gradient(sim, start, list(cohort)), mean)
    for k in exact:
        torch.testing.assert_close(mean[k], exact[k], rtol=0, atol=1e-9)


@pytest.mark.parametrize("sampling", ["fixed", "bernoulli"])
def test_monte_carlo_mean_over_the_real_sampler_matches_the_exact_gradient(sampling):
    sim = prepared(participation=0.5, sampling=sampling)
    start, exact = start_of(sim), exact_gradient(sim)
    draws = 300
    samples = [stochastic_gradient(sim, start, t=t) for t in range(draws)]
    flat = torch.stack([torch.cat([s[k].flatten() for k in exact]) for s in samples])
    target = torch.cat([exact[k].flatten() for k in exact])
    error = (flat.mean(0) - target).norm()
    standard_error = (
        flat.var(0).sum() / draws
    ).sqrt()  # E||mean - g||^2 = sum of variances / draws
    assert error < 3 * standard_error
    biased = (
        flat.mean(0) * sim.context(0).cohort_size / sim.context(0).num_clients - target
    ).norm()
    assert biased > 3 * standard_error  # without the I/r factor the same check fails


class _CountBackward(torch.autograd.Function):
    """Identity whose backward counts how often gradients flow back through the body."""

    calls = 0

    @staticmethod
    def forward(x):
        return x.clone()

    @staticmethod
    def setup_context(ctx, inputs, output):
        pass

    @staticmethod
    def backward(ctx, grad):
        _CountBackward.calls += 1
        return grad


class _CountedBody(nn.Module):
    def __init__(self, body: nn.Module) -> None:
        super().__init__()
        self.inner = body
        self.forward_calls = 0

    def forward(self, x):
        self.forward_calls += 1
        return _CountBackward.apply(self.inner(x))


@pytest.mark.parametrize("tau", [1, 5, 30])
@pytest.mark.parametrize("batch_size", [None, 3])
def test_body_runs_one_forward_and_one_backward_per_client_whatever_tau(tau, batch_size):
    # Per-client counts are those of the reference loop; under vmap the same forwards and one
    # backward run once for the whole cohort (tests/test_fast_sim.py counts its FLOPs). Full
    # batch, the joint gradient reuses the features' forward pass; with minibatches, its batch
    # runs a second, small forward.
    exp = tiny_experiment(
        algorithm="pflego",
        inner_steps=tau,
        participation=0.5,
        backend="loop",
        batch_size=batch_size,
    )
    body = exp.algorithm.model.body = _CountedBody(exp.algorithm.model.body)
    sim = Simulation(exp, None)
    _CountBackward.calls = 0
    sim.run_round(0)
    cohort = len(sim.cohort(0))
    forwards = 1 if batch_size is None else 2
    assert (body.forward_calls, _CountBackward.calls) == (forwards * cohort, cohort)


def test_eq3_head_step_is_the_exact_step_divided_by_alpha():
    exact, eq3 = (
        prepared(participation=1.0),
        prepared(participation=1.0, options={"head_step": "eq3"}),
    )
    before = snapshot(exact)
    exact.run_round(0)
    eq3.run_round(0)
    alpha = exact.exp.data.train_sizes.double() / exact.exp.data.total_train
    for k in ("client.head.weight", "client.head.bias"):
        step_exact, step_eq3 = before[k] - snapshot(exact)[k], before[k] - snapshot(eq3)[k]
        shape = (-1,) + (1,) * (step_exact.dim() - 1)
        torch.testing.assert_close(step_eq3 * alpha.view(shape), step_exact, rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(snapshot(exact)["body.1.weight"], snapshot(eq3)["body.1.weight"])


def test_inner_steps_descend_the_local_loss_on_cached_features():
    sim = prepared(
        participation=1.0, inner_steps=20, client_lr=0.5, server_lr=1e-12
    )  # theta ~ fixed
    data = sim.exp.data
    ctx = sim.context(0)
    down = sim.algorithm.downlink(sim.server, ctx)

    def local_losses():
        return torch.stack(
            [
                F.cross_entropy(
                    sim.algorithm.predict(
                        down,
                        sim.store.get(i),
                        data.inputs(data.x_train[data.train_slice(i)]).double(),
                    ),
                    data.y_train_local[data.train_slice(i)],
                )
                for i in range(data.num_clients)
            ]
        )

    before = local_losses()
    sim.run_round(0)
    assert (local_losses() < before).all()


def test_unknown_head_step_is_rejected():
    with pytest.raises(ConfigError, match="head_step"):
        tiny_experiment(algorithm="pflego", options={"head_step": "approx"})


# --- r drawn uniformly each round (the paper's Figure 4 participation) -------------------------

UNIFORM = {"sampling": "uniform-count", "min_cohort": 2, "max_cohort": 4}


def uniform_count_mean(sim: Simulation, start: dict, context_size) -> dict[str, torch.Tensor]:
    """E[step / rho] over r uniform on {2, 3, 4} and every cohort of that size (each with
    probability 1/3 * 1/C(6, r)), with the context's cohort size ``context_size(r)``."""
    counts = range(UNIFORM["min_cohort"], UNIFORM["max_cohort"] + 1)
    mean: dict[str, torch.Tensor] = {}
    for r in counts:
        cohorts = list(itertools.combinations(range(sim.exp.data.num_clients), r))
        sim.sampling.cohort_count = lambda t, rng=None, r=r: context_size(r)
        for cohort in cohorts:
            step = stochastic_gradient(sim, start, list(cohort))
            mean = tree.axpy(1 / len(counts) / len(cohorts), step, mean or tree.zeros_like(step))
    return mean


def test_uniform_count_scaling_is_unbiased_by_exact_enumeration():
    sim = prepared(**UNIFORM)
    start, exact = start_of(sim), exact_gradient(sim)
    mean = uniform_count_mean(sim, start, lambda r: r)  # the round's own I / r_t
    for k in exact:
        torch.testing.assert_close(mean[k], exact[k], rtol=0, atol=1e-9)
    # The enumeration is sharp: scaling by I / max_cohort instead is biased by E[r] / 4 = 3/4.
    biased = uniform_count_mean(sim, start, lambda r: UNIFORM["max_cohort"])
    for k in exact:
        torch.testing.assert_close(biased[k], 0.75 * exact[k], rtol=0, atol=1e-9)


def test_uniform_count_context_and_cohort_draw_the_same_r():
    sim = prepared(**UNIFORM)
    sizes = []
    for t in range(300):
        cohort = sim.cohort(t)
        assert sim.context(t).cohort_size == len(cohort) == len(set(cohort.tolist()))
        sizes.append(len(cohort))
    counts = np.bincount(sizes, minlength=5)[2:]
    assert counts.sum() == 300 and (counts > 70).all()  # each of 2, 3, 4 about 100 times
    again = prepared(**UNIFORM)
    assert all(np.array_equal(again.cohort(t), sim.cohort(t)) for t in range(20))


def test_uniform_count_monte_carlo_over_the_real_sampler_matches_the_exact_gradient():
    sim = prepared(**UNIFORM)
    start, exact = start_of(sim), exact_gradient(sim)
    draws = 300
    samples = [stochastic_gradient(sim, start, t=t) for t in range(draws)]
    flat = torch.stack([torch.cat([s[k].flatten() for k in exact]) for s in samples])
    target = torch.cat([exact[k].flatten() for k in exact])
    standard_error = (flat.var(0).sum() / draws).sqrt()
    assert (flat.mean(0) - target).norm() < 3 * standard_error


@pytest.mark.parametrize(
    "settings,message",
    [
        ({"sampling": "uniform-count"}, "min_cohort >= 1"),
        ({"sampling": "uniform-count", "min_cohort": 5, "max_cohort": 3}, "exceeds max_cohort"),
        ({"min_cohort": 2}, "applies only to sampling=uniform-count"),
        ({"sampling": "uniform-count", "min_cohort": 2, "max_cohort": 7}, "exceeds the 6 clients"),
    ],
)
def test_uniform_count_bounds_are_checked(settings, message):
    with pytest.raises(ConfigError, match=message):
        tiny_experiment(algorithm="pflego", **settings)


def minibatch_round(sim: Simulation, client: int, head_batch, joint_batch):
    """PFLEGO's client update on the client's first 4 samples with the given batches (n=4, B=2,
    tau=2): returns the gradient it steps along, (g_theta, g_W), flattened."""
    algorithm, ctx = sim.algorithm, sim.context(0)
    down = algorithm.downlink(sim.server, ctx)
    state = sim.store.get(client)
    data = sim.exp.data
    sl = data.train_slice(client)
    unused = [i for i in range(4) if i not in head_batch]  # the run schedule's last row
    inputs = ClientData(
        x=data.inputs(data.x_train[sl][:4]).double(),
        y=data.y_train_local[sl][:4],
        mask=torch.ones(4, dtype=torch.float64),
        batches=torch.tensor([list(head_batch), unused]),
        batch_mask=torch.ones(2, 2, dtype=torch.float64),
        label_mask=(data.client_classes[client] >= 0).double(),
        num_samples=torch.tensor(4.0, dtype=torch.float64),
        schedules={
            "joint": (torch.tensor([list(joint_batch)]), torch.ones(1, 2, dtype=torch.float64))
        },
    )
    out, new_head = algorithm.client_update(down, state, inputs, ctx)
    head = reference_head_step(sim, client, head_batch)
    scale = ctx.server_lr * ctx.inverse_inclusion * 4 / ctx.total_samples
    g_head = {k: (head[k] - new_head[k]) / scale for k in head}
    return torch.cat([v.flatten() for v in (*out.upload.values(), *g_head.values())])


def local_loss(sim: Simulation, client: int, theta, head, batch):
    """Client ``client``'s cross-entropy on the samples ``batch`` of its first 4 (by hand)."""
    data, model = sim.exp.data, sim.algorithm.model
    sl = data.train_slice(client)
    x, y = data.inputs(data.x_train[sl][:4]).double()[batch], data.y_train_local[sl][:4][batch]
    k = int((data.client_classes[client] >= 0).sum())
    logits = model.features(theta, x) @ head["head.weight"][:k].T + head["head.bias"][:k]
    return F.cross_entropy(logits, y)


def reference_head_step(sim: Simulation, client: int, batch) -> dict[str, torch.Tensor]:
    """W after one head step of size beta on ``batch`` (theta fixed), written with autograd."""
    theta = sim.server["params"]
    head = {k: v.clone().requires_grad_(True) for k, v in sim.store.get(client).items()}
    grads = torch.autograd.grad(
        local_loss(sim, client, theta, head, list(batch)), list(head.values())
    )
    beta = sim.context(0).client_lr
    return {k: (v - beta * g).detach() for (k, v), g in zip(head.items(), grads, strict=True)}


def reference_full_gradient(sim: Simulation, client: int, head) -> torch.Tensor:
    """(g_theta, g_W) of the client's loss on all 4 samples at (theta, W), flattened."""
    theta = {k: v.clone().requires_grad_(True) for k, v in sim.server["params"].items()}
    head = {k: v.clone().requires_grad_(True) for k, v in head.items()}
    loss = local_loss(sim, client, theta, head, [0, 1, 2, 3])
    grads = torch.autograd.grad(loss, [*theta.values(), *head.values()])
    return torch.cat([g.flatten() for g in grads])


def test_minibatch_joint_gradient_is_unbiased_given_the_head():
    """n = 4, B = 2, tau = 2: for every head batch (hence every head W after the head step),
    the mean of the joint gradient over the 6 equally likely joint batches is the full local
    gradient at W. Taking the joint batch from the head batch's epoch (the 2 samples the head
    step did not see) is biased given W: the contrast."""
    sim = prepared(batch_size=2, inner_steps=2, participation=1.0)
    client = int(torch.nonzero(sim.exp.data.train_sizes >= 4)[0])
    pairs = list(itertools.combinations(range(4), 2))
    old_bias = []
    for head_batch in pairs:
        exact = reference_full_gradient(sim, client, reference_head_step(sim, client, head_batch))
        draws = torch.stack([minibatch_round(sim, client, head_batch, j) for j in pairs])
        torch.testing.assert_close(draws.mean(0), exact, rtol=0, atol=1e-10)
        rest = [i for i in range(4) if i not in head_batch]
        old_bias.append(float((minibatch_round(sim, client, head_batch, rest) - exact).norm()))
    # ||E[g_old - g_full | W]|| for each of the 6 heads W: far from zero (about 1.1 to 3.1 here).
    assert min(old_bias) > 0.5


def test_the_joint_batch_is_drawn_uniformly_and_apart_from_the_head_batches():
    """Over 3,600 rounds of one client (n = 4, B = 2, tau = 2) every (head batch, joint batch)
    pair of the real sampler is equally frequent: the joint batch is uniform and independent."""
    algorithm = prepared(batch_size=2, inner_steps=2).algorithm
    run = Schedule(2, 2)
    assert algorithm.schedules(run) == {"joint": Schedule(1, 2)}
    counts = torch.zeros(6, 6)
    index = {p: k for k, p in enumerate(itertools.combinations(range(4), 2))}
    for t in range(3600):
        (batches, _), named = client_schedules(
            4, run, algorithm.schedules(run), lambda s, t=t: minibatch_rng(0, t, 3, s)
        )
        head = tuple(sorted(batches[0].tolist()))
        joint = tuple(sorted(named["joint"][0][0].tolist()))
        counts[index[head], index[joint]] += 1
    chi2 = float(((counts - 100) ** 2 / 100).sum())
    assert chi2 < 66.6  # the 99.9% quantile of chi-square with 35 degrees of freedom
