"""FedDyn's client objective, gradient state and server h, against hand-written float64 references."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import tiny_experiment

from pflego.local import fused_steps
from pflego.sim import Simulation
from pflego.sim.clients import client_data, schedule
from pflego.types import ClientOut

ALPHA = 0.3


def mlp_logits(params: dict, x: torch.Tensor) -> torch.Tensor:
    """The tiny experiment's model written out: Flatten -> Linear 200 -> ReLU -> linear head."""
    hidden = torch.relu(x.flatten(1) @ params["body.1.weight"].T + params["body.1.bias"])
    return hidden @ params["head.weight"].T + params["head.bias"]


def random_like(params: dict, seed: int, scale: float) -> dict:
    gen = torch.Generator().manual_seed(seed)
    return {
        k: scale * torch.randn(v.shape, generator=gen, dtype=torch.float64)
        for k, v in params.items()
    }


def test_local_steps_descend_the_dynamic_objective_and_update_the_gradient_state():
    sim = Simulation(tiny_experiment(algorithm="feddyn", options={"alpha": ALPHA}), None)
    ctx = sim.context(0)
    theta = sim.server["params"]
    grad_state = random_like(theta, 1, 0.05)  # grad L_k(theta_k^{t-1}) from an earlier visit
    client, steps = 2, 3
    n = int(sim.exp.data.train_sizes[client])
    batches = schedule(n, steps, None, None, np.random.default_rng(0))
    data = client_data(sim.exp.data, client, "global", batches, torch.float64)
    state = {"grad." + k: v for k, v in grad_state.items()}
    out, new_state = sim.algorithm.client_update(theta, state, data, ctx)

    # Reference: gradient descent on L_k(w) - <g, w> + alpha/2 ||w - theta||^2, gradient by hand
    # for the two regularizer terms and by autograd for the cross-entropy.
    w, losses = {k: v.clone() for k, v in theta.items()}, []
    for _ in range(steps):
        leaves = {k: v.clone().requires_grad_() for k, v in w.items()}
        ce = torch.nn.functional.cross_entropy(mlp_logits(leaves, data.x), data.y)
        losses.append(float(ce))
        grads = dict(zip(leaves, torch.autograd.grad(ce, list(leaves.values()))))
        w = {
            k: v - ctx.client_lr * (grads[k] - grad_state[k] + ALPHA * (v - theta[k]))
            for k, v in w.items()
        }
    for k in theta:
        torch.testing.assert_close(out.upload[k], theta[k] - w[k], rtol=1e-10, atol=1e-12)
        expected = grad_state[k] - ALPHA * (w[k] - theta[k])
        torch.testing.assert_close(new_state["grad." + k], expected, rtol=1e-10, atol=1e-12)
    assert out.weight == n
    # the logged loss is L_k's at each step's start, without the regularizers' values
    assert float(out.metrics["loss"]) == pytest.approx(sum(losses) / steps, rel=1e-10)


def test_fused_steps_run_the_regularizers_as_autograd_does():
    """FedDyn's proximal and linear terms ride on the optimizer: fused steps take them in the
    kernel's pull and compute what the autograd steps compute, logged loss included."""
    sim = Simulation(tiny_experiment(algorithm="feddyn", options={"alpha": ALPHA}), None)
    ctx, theta = sim.context(0), sim.server["params"]
    state = {"grad." + k: v for k, v in random_like(theta, 1, 0.05).items()}
    n = int(sim.exp.data.train_sizes[2])
    batches = schedule(n, 4, 3, None, np.random.default_rng(0))
    data = client_data(sim.exp.data, 2, "global", batches, torch.float64)
    plain = sim.algorithm.client_update(theta, state, data, ctx)
    with fused_steps() as counts:
        fused = sim.algorithm.client_update(theta, state, data, ctx)
    assert counts.fused > 0 and counts.autograd == 0
    for k in theta:
        torch.testing.assert_close(fused[0].upload[k], plain[0].upload[k], rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(
        fused[0].metrics["loss"], plain[0].metrics["loss"], rtol=1e-10, atol=0
    )


def test_server_h_uses_the_population_and_the_model_the_cohort_mean():
    sim = Simulation(tiny_experiment(algorithm="feddyn", options={"alpha": ALPHA}), None)
    ctx = sim.context(0)
    assert ctx.num_clients == 6
    theta = sim.server["params"]
    h = random_like(theta, 2, 0.01)
    cohort = torch.tensor([1, 3, 4])
    local = [random_like(theta, 10 + c, 0.1) for c in range(3)]
    local = [{k: theta[k] + d[k] for k in theta} for d in local]  # theta_k^t
    uploads = {k: torch.stack([theta[k] - m[k] for m in local]) for k in theta}
    sizes = torch.tensor([5.0, 50.0, 500.0], dtype=torch.float64)  # FedDyn's mean ignores N_k
    out = ClientOut(uploads, sizes, {})
    new = sim.algorithm.server_round({"params": theta, "h": h}, out, ctx, cohort)
    for k in theta:
        drift = sum(m[k] - theta[k] for m in local)
        h_ref = h[k] - ALPHA * drift / 6
        theta_ref = sum(m[k] for m in local) / 3 - h_ref / ALPHA
        torch.testing.assert_close(new["h"][k], h_ref, rtol=1e-12, atol=1e-14)
        torch.testing.assert_close(new["params"][k], theta_ref, rtol=1e-12, atol=1e-14)


def test_unvisited_clients_start_with_a_zero_gradient_state_and_predict_with_the_global_model():
    sim = Simulation(tiny_experiment(algorithm="feddyn"), None)
    ctx = sim.context(0)
    state = sim.client_state(0, sim.server["params"], ctx)
    assert all(torch.count_nonzero(v) == 0 for v in state.values())
    x = torch.randn(3, 1, 4, 4, dtype=torch.float64)
    logits = sim.algorithm.predict(sim.server["params"], state, x)
    torch.testing.assert_close(logits, mlp_logits(sim.server["params"], x))
