"""FedALA against a hand-written float64 reference on ragged clients: the adaptive local
aggregation (element-wise weights learned on s% of the data, until convergence at a client's
first ALA and for one epoch after), the local training from its result, and FedAvg."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from test_baselines import assert_close, descend, logits, steps_of
from test_fast_sim import ragged_experiment

from pflego.errors import ConfigError
from pflego.sim import Simulation

MODEL = ("body.1.weight", "body.1.bias", "head.weight", "head.bias")
OPTIONS = {"threshold": 0.02, "num_pre_loss": 3, "max_start_epochs": 12, "rand_percent": 70.0}


def ala_reference(glob, local, weights, data, top, eta, percent, first, options):
    """ALA as the authors' ALA.py writes it: the weight learning's steps (gradient at the temp
    model, times Theta - theta_i, clipped to [0, 1]) on the first floor(s/100 N) entries of the
    shuffled ``ala`` epoch, repeated until the std of the last epoch losses is small (first ALA)
    or once. Returns the initialized local model, the weights and the epochs run."""
    count = int(percent / 100 * len(data.y))
    idx, mask = data.schedules["ala"]
    batches, seen = [], 0
    for row, m in zip(idx, mask, strict=True):
        rows = [int(j) for j, real in zip(row, m, strict=True) if real > 0]
        take = rows[: max(0, count - seen)]
        seen += len(rows)
        if take:
            batches.append((data.x[take], data.y[take]))
    weights = {k: w.clone() for k, w in weights.items()}
    temp = lambda: {  # noqa: E731
        **glob,
        **{k: local[k] + (glob[k] - local[k]) * weights[k] for k in top},
    }
    losses, epochs = [], 0
    while True:
        for x, y in batches:
            leaves = {k: v.clone().requires_grad_(True) for k, v in temp().items()}
            loss = F.cross_entropy(logits(leaves, x), y)
            grads = torch.autograd.grad(loss, [leaves[k] for k in top])
            for k, g in zip(top, grads, strict=True):
                weights[k] = torch.clamp(weights[k] - eta * (g * (glob[k] - local[k])), 0, 1)
        losses.append(float(loss.detach()))
        epochs += 1
        if not first:
            break
        recent = losses[-options["num_pre_loss"] :]
        if len(losses) > options["num_pre_loss"] and np.std(recent) < options["threshold"]:
            break
        if epochs == options["max_start_epochs"]:  # pflego's cap (the authors have none)
            break
    return temp(), weights, epochs


@pytest.mark.parametrize(
    ("setting", "top"),
    [
        ({"batch_size": 4, "local_epochs": 1.0}, ("head.weight", "head.bias")),
        ({"batch_size": 3, "local_epochs": 1.0, "options": {"layers": 2}}, MODEL),
        ({"inner_steps": 2}, ("head.weight", "head.bias")),
    ],
    ids=["head-minibatch", "two-layers-minibatch", "head-full-batch"],
)
def test_fedala_rounds_equal_the_papers_updates(setting, top):
    setting = {**setting, "options": {**OPTIONS, **setting.get("options", {})}}
    sim = Simulation(ragged_experiment("fedala", participation=1.0, **setting), None)
    options = setting["options"]
    local: dict[int, dict] = {}
    weights: dict[int, dict] = {}
    started: set[int] = set()
    epochs_run = []
    for t in range(3):
        ctx, cohort = sim.context(t), sim.cohort(t)
        glob = {k: v.clone() for k, v in sim.server["params"].items()}
        inputs = sim.round_inputs(t, cohort)
        trained = []
        for c, i in enumerate(int(i) for i in cohort):
            data = inputs.client(c)
            w = weights.get(i, {k: torch.ones_like(glob[k]) for k in top})
            if i in local:  # ALA from the old local model; skipped before the first training
                first = i not in started
                start, w, epochs = ala_reference(
                    glob, local[i], w, data, top, 1.0, options["rand_percent"], first, options
                )
                started.add(i)
                epochs_run.append((first, epochs))
            else:
                start = glob
            local[i] = descend(start, MODEL, lambda p, x, y: F.cross_entropy(logits(p, x), y),
                               steps_of(data), lr=ctx.client_lr)  # fmt: skip
            weights[i] = w
            trained.append(local[i])
        sizes = [inputs.client(c).num_samples for c in range(len(cohort))]
        total = sum(sizes)
        expected = {k: sum(n / total * m[k] for n, m in zip(sizes, trained)) for k in glob}
        sim.run_round(t)
        assert_close(sim.server["params"], expected)
        for i in local:
            state = sim.store.get(i)
            assert_close({k[6:]: v for k, v in state.items() if k.startswith("local.")}, local[i])
            assert_close(
                {k[8:]: v for k, v in state.items() if k.startswith("weights.")}, weights[i]
            )
    # Each client predicts with its own trained local model, not the global one.
    downlink = sim.algorithm.downlink(sim.server, sim.context(3))
    x = inputs.client(0).x
    for i, model in local.items():
        predicted = sim.algorithm.predict(downlink, sim.store.get(i), x)
        torch.testing.assert_close(predicted, logits(model, x), rtol=1e-10, atol=1e-12)
    # The first ALA of every client ran several epochs, some stopping before the cap; later ones one.
    firsts = [e for first, e in epochs_run if first]
    assert firsts and all(e > options["num_pre_loss"] for e in firsts)
    assert any(e < options["max_start_epochs"] for e in firsts)
    assert all(e == 1 for first, e in epochs_run if not first)
    moved = [float((w[top[0]] - 1).abs().max()) for w in weights.values()]
    assert max(moved) > 1e-3  # the weights were learned, not left at 1


def test_the_cohort_runs_the_long_first_phase_only_when_one_of_it_needs_it():
    sim = Simulation(ragged_experiment("fedala", participation=0.5, options=OPTIONS), None)
    epochs = []
    for t in range(4):
        ctx, cohort = sim.context(t), sim.cohort(t)
        epochs.append(sim.downlink(ctx, cohort)["ala.epochs"].shape[-1])
        visits = sim.server["ala"]["visits"] if "ala" in sim.server else torch.zeros(6)
        needs = bool((visits[torch.as_tensor(cohort)] == 1).any())
        assert epochs[-1] == (OPTIONS["max_start_epochs"] if needs else 1)
        sim.run_round(t)
    assert epochs[0] == 1 and OPTIONS["max_start_epochs"] in epochs


def test_the_top_layers_are_counted_from_the_output():
    sim = Simulation(ragged_experiment("fedala", options={"layers": 2}), None)
    assert sim.algorithm.top_names(sim.server["params"]) == MODEL
    head = Simulation(ragged_experiment("fedala"), None).algorithm
    assert head.top_names(sim.server["params"]) == ("head.weight", "head.bias")


@pytest.mark.parametrize(
    "options", [{"eta": 0.0}, {"rand_percent": 0.0}, {"layers": 0}, {"max_start_epochs": 0}]
)
def test_bad_options_are_one_line_errors(options):
    with pytest.raises(ConfigError):
        ragged_experiment("fedala", options=options)


def test_a_new_client_predicts_with_the_global_model_until_it_joins_and_then_its_own():
    """Before training a client predicts with the global model; ``join`` (no local model, so no
    ALA) trains the global model with the run's schedule, and the client predicts with that."""
    sim = Simulation(ragged_experiment("fedala", batch_size=3, local_epochs=1.0), None)
    sim.run_round(0)
    ctx, cohort = sim.context(1), sim.cohort(1)
    data = sim.round_inputs(1, cohort).client(0)
    glob = {k: v.clone() for k, v in sim.server["params"].items()}
    downlink = sim.algorithm.downlink(sim.server, ctx)
    first_visit = sim.init_state(int(cohort[0]), downlink, ctx)
    loss = lambda p, x, y: F.cross_entropy(logits(p, x), y)  # noqa: E731
    expected = descend(glob, MODEL, loss, steps_of(data), lr=ctx.client_lr)
    predict = sim.algorithm.predict
    exact = dict(rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(
        predict(downlink, first_visit, data.x), logits(glob, data.x), **exact
    )
    joined = sim.algorithm.join(downlink, first_visit, data, ctx)
    assert_close({k[6:]: v for k, v in joined.items() if k.startswith("local.")}, expected)
    torch.testing.assert_close(predict(downlink, joined, data.x), logits(expected, data.x), **exact)
