"""PGFed, PGFedMo and PGFed-CE against hand-written autograd references (float64, ragged clients)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from test_baselines import logits
from test_fast_sim import ragged_experiment

from pflego import tree
from pflego.algorithms.pgfed import PGFed
from pflego.algorithms.pgfed_ce import PGFedCE
from pflego.errors import ConfigError
from pflego.sim import Simulation, metrics
from pflego.sim.backends import loop_backend

MU, LAM = 0.3, 0.05
SETTINGS = {
    "full-batch": {"inner_steps": 3},
    "minibatch": {"batch_size": 4, "local_epochs": 1.0},
}


def simulation(name: str = "pgfed", setting: str = "full-batch", **options) -> Simulation:
    options = {"mu": MU, "lam": LAM, "nonnegative": False, **options}
    return Simulation(ragged_experiment(name, options=options, **SETTINGS[setting]), None)


def risk(sim: Simulation, params: dict, i: int) -> torch.Tensor:
    """f_i(params): mean cross-entropy over client i's whole training split."""
    data = sim.exp.data
    sl = data.train_slice(i)
    x, y = data.inputs(data.x_train[sl]).double(), data.y_train[sl]
    return F.cross_entropy(sim.algorithm.model.forward(params, x), y)


def gradient(sim: Simulation, params: dict, i: int) -> tuple[dict, torch.Tensor]:
    """(grad f_i, f_i) at ``params`` with autograd."""
    leaves = {k: v.detach().clone().requires_grad_(True) for k, v in params.items()}
    value = risk(sim, leaves, i)
    grads = torch.autograd.grad(value, list(leaves.values()))
    return dict(zip(leaves, grads, strict=True)), value.detach()


def local_model(sim: Simulation, i: int) -> dict:
    return {
        k[len("local.") :]: v[i].clone()
        for k, v in sim.store.tensors.items()
        if k.startswith("local.")
    }


def reference_trajectory(sim, theta, aux, data, lr):
    """SGD on f_i(theta; batch) + <aux, theta> step by step; returns the model and the iterates."""
    iterates = []
    for idx, bmask in zip(data.batches, data.batch_mask, strict=True):
        if bmask.sum() == 0:
            continue
        iterates.append({k: v.clone() for k, v in theta.items()})
        leaves = {k: v.clone().requires_grad_(True) for k, v in theta.items()}
        real = bmask > 0
        logits = sim.algorithm.model.forward(leaves, data.x[idx[real]])
        loss = F.cross_entropy(logits, data.y[idx[real]])
        grads = torch.autograd.grad(loss, list(leaves.values()))
        theta = {k: theta[k] - lr * (g + aux[k]) for k, g in zip(leaves, grads, strict=True)}
    return theta, iterates


@pytest.mark.parametrize("setting", SETTINGS)
@pytest.mark.parametrize("alpha_gradient", ["exact", "mean"])
def test_pgfed_round_equals_the_papers_updates(setting, alpha_gradient):
    sim = simulation(setting=setting, alpha_gradient=alpha_gradient)
    sim.run_round(0)
    ctx, before, now = sim.context(1), sim.cohort(0), sim.cohort(1)
    M = ctx.cohort_size
    data = sim.exp.data

    # The server's memory: the previous cohort's full-batch gradients and offsets at their models.
    memory = sim.server["pgfed"]
    assert memory["ids"].tolist() == before.tolist()
    g, f, theta = {}, {}, {j: local_model(sim, j) for j in before}
    for j in before:
        g[j], f[j] = gradient(sim, theta[j], j)
    for row, j in enumerate(before):
        for k, v in g[j].items():
            torch.testing.assert_close(memory[f"grad.{k}"][row], v)
        offset = MU * (f[j] - tree.dot(g[j], theta[j]))
        torch.testing.assert_close(memory["offsets"][row], offset)
    # The global model is the N_i-weighted average of the cohort's local models.
    sizes = data.train_sizes[before].double()
    for k, v in sim.server["params"].items():
        mean = sum(n * theta[j][k] for n, j in zip(sizes, before, strict=True)) / sizes.sum()
        torch.testing.assert_close(v, mean)

    # Round 1: each client descends grad f_i + mu sum_j a_ij g_j with a_ij = 1/M (Eq. 10, 13).
    theta_glob = {k: v.clone() for k, v in sim.server["params"].items()}  # before round 1
    inputs = sim.round_inputs(1, now)
    aux = {}
    for c, i in enumerate(now):
        aux[i] = {k: MU * sum(g[j][k] / M for j in before) for k in theta_glob}
        downlink = sim.one_downlink(sim.downlink(ctx, now), int(i), c)
        for k in theta_glob:
            torch.testing.assert_close(downlink[f"aux.{k}"], aux[i][k])
    A_before = sim.server["pgfed"]["A"].clone()
    assert torch.allclose(A_before, torch.full_like(A_before, 1 / M))
    sim.run_round(1)

    A = sim.server["pgfed"]["A"]
    for c, i in enumerate(now):
        one = inputs.client(c)
        theta_i, iterates = reference_trajectory(sim, theta_glob, aux[i], one, ctx.client_lr)
        for k, v in local_model(sim, i).items():
            torch.testing.assert_close(v, theta_i[k])
        # The row a_i takes one gradient step per local step, with Eq. 11's gradient per j.
        a = torch.full((len(before),), 1 / M, dtype=torch.float64, requires_grad=True)
        auxiliary_risk = 0.0
        for point in iterates:
            if alpha_gradient == "exact":  # mu sum_j a_ij (f_j + g_j^T (theta_i - theta_j)), Eq. 9
                terms = [f[j] + tree.dot(g[j], tree.sub(point, theta[j])) for j in before]
            else:  # Eq. 12: g_j^T theta_i replaced by the mean over j'
                mean_dot = sum(tree.dot(g[j], point) for j in before) / len(before)
                terms = [f[j] - tree.dot(g[j], theta[j]) + mean_dot for j in before]
            auxiliary_risk = auxiliary_risk + MU * (a * torch.stack(terms)).sum()
        (per_step_sum,) = torch.autograd.grad(auxiliary_risk, a)
        expected = 1 / M - LAM * per_step_sum
        torch.testing.assert_close(A[i, torch.as_tensor(before)], expected.detach())
        assert not torch.allclose(expected, torch.full_like(expected, 1 / M))
    # Rows of clients that did not train, and columns of clients absent last round, are unchanged.
    untouched = torch.ones_like(A, dtype=torch.bool)
    untouched[torch.as_tensor(now)[:, None], torch.as_tensor(before)[None, :]] = False
    assert torch.equal(A[untouched], A_before[untouched])


def hand_risk(sim: Simulation, params: dict, i: int) -> torch.Tensor:
    """f_i(params) with the MLP written out: mean cross-entropy over client i's training split."""
    data = sim.exp.data
    sl = data.train_slice(i)
    x, y = data.inputs(data.x_train[sl]).double(), data.y_train[sl]
    return F.cross_entropy(logits(params, x), y)


def hand_trajectory(theta: dict, aux: dict, data, lr: float) -> tuple[dict, list[dict]]:
    """Plain SGD on f_i(theta; batch) + <aux, theta> with the written-out MLP; returns the model
    and the point of each real step."""
    iterates = []
    for idx, bmask in zip(data.batches, data.batch_mask, strict=True):
        if bmask.sum() == 0:
            continue
        iterates.append(theta)
        leaves = {k: v.clone().requires_grad_(True) for k, v in theta.items()}
        x, y = data.x[idx[bmask > 0]], data.y[idx[bmask > 0]]
        grads = torch.autograd.grad(F.cross_entropy(logits(leaves, x), y), list(leaves.values()))
        theta = {
            k: (theta[k] - lr * (g + aux[k])).detach() for k, g in zip(leaves, grads, strict=True)
        }
    return theta, iterates


@pytest.mark.parametrize("setting", SETTINGS)
@pytest.mark.parametrize("alpha_gradient", ["exact", "mean"])
@pytest.mark.parametrize("name", ["pgfed", "pgfed-ce"])
def test_a_round_from_a_non_uniform_non_symmetric_a(name, alpha_gradient, setting):
    """Round 1 from a random A with a_ij != a_ji, against a float64 reference written here.

    The downlink of client i weights g_j by a_ij (Eq. 13), not a_ji; row i then takes one step of
    Eq. 11 per local step. PGFed takes it at each iterate theta_i^(s); PGFed-CE (Appendix D, Eq. 16)
    at theta_glob for the whole round, so its row moves by -lambda S_i (g1_j + mu g_j^T theta_glob).
    """
    sim = simulation(name, setting, alpha_gradient=alpha_gradient)
    sim.run_round(0)
    ctx, before, now = sim.context(1), sim.cohort(0), sim.cohort(1)
    start = torch.rand(6, 6, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    start = start + 0.1 * torch.arange(36, dtype=torch.float64).reshape(6, 6) / 36
    assert not torch.allclose(start, start.T)
    sim.server["pgfed"]["A"] = start.clone()
    theta = {j: local_model(sim, j) for j in before}
    g, f = {}, {}
    for j in before:
        leaves = {k: v.clone().requires_grad_(True) for k, v in theta[j].items()}
        value = hand_risk(sim, leaves, j)
        g[j] = dict(zip(leaves, torch.autograd.grad(value, list(leaves.values())), strict=True))
        f[j] = value.detach()
    theta_glob = {k: v.clone() for k, v in sim.server["params"].items()}
    inputs = sim.round_inputs(1, now)
    downlink = sim.downlink(ctx, now)
    sim.run_round(1)

    columns = torch.as_tensor(before)
    for c, i in enumerate(now):
        aux = {k: MU * sum(start[i, j] * g[j][k] for j in before) for k in theta_glob}
        sent = sim.one_downlink(downlink, int(i), c)
        for k, v in aux.items():
            torch.testing.assert_close(sent[f"aux.{k}"], v, rtol=1e-10, atol=1e-12)
        theta_i, iterates = hand_trajectory(theta_glob, aux, inputs.client(c), ctx.client_lr)
        for k, v in local_model(sim, i).items():
            torch.testing.assert_close(v, theta_i[k], rtol=1e-9, atol=1e-11)
        points = iterates if name == "pgfed" else [theta_glob] * len(iterates)
        a = start[i, columns].clone().requires_grad_(True)
        auxiliary_risk = 0.0
        for point in points:
            dots = torch.stack([sum((g[j][k] * point[k]).sum() for k in point) for j in before])
            if alpha_gradient == "mean":
                dots = dots.mean().expand(len(before))
            offsets = torch.stack(
                [f[j] - sum((g[j][k] * theta[j][k]).sum() for k in g[j]) for j in before]
            )
            auxiliary_risk = auxiliary_risk + MU * (a * (offsets + dots)).sum()
        (step_sum,) = torch.autograd.grad(auxiliary_risk, a)
        expected = start[i, columns] - LAM * step_sum
        torch.testing.assert_close(sim.server["pgfed"]["A"][i, columns], expected.detach())


@pytest.mark.parametrize("keep", [False, True])
def test_keep_optimizer_carries_the_momentum_buffers_across_rounds(keep):
    """With mu = 0 a PGFed client runs momentum SGD on its risk from theta_glob. The buffers
    restart every round by default and, with keep_optimizer (the authors' client), carry over:
    torch.optim.SGD(momentum=0.9) written out, its first ever step copying the gradient."""
    options = {"mu": 0.0, "lam": LAM, "keep_optimizer": keep}
    settings = {**SETTINGS["minibatch"], "client_optimizer": "momentum", "participation": 1.0}
    sim = Simulation(ragged_experiment("pgfed", options=options, **settings), None)
    buffers: dict[int, dict] = {}
    for t in range(2):  # every client trains in both rounds
        ctx, cohort = sim.context(t), sim.cohort(t)
        theta_glob = {k: v.clone() for k, v in sim.server["params"].items()}
        inputs = sim.round_inputs(t, cohort)
        expected = {}
        for c, i in enumerate(cohort):
            data, theta = inputs.client(c), dict(theta_glob)
            buf = buffers.get(int(i)) if keep else None
            for idx, bmask in zip(data.batches, data.batch_mask, strict=True):
                if bmask.sum() == 0:
                    continue
                leaves = {k: v.clone().requires_grad_(True) for k, v in theta.items()}
                x, y = data.x[idx[bmask > 0]], data.y[idx[bmask > 0]]
                loss = F.cross_entropy(logits(leaves, x), y)
                grads = dict(zip(leaves, torch.autograd.grad(loss, list(leaves.values()))))
                buf = grads if buf is None else {k: 0.9 * buf[k] + grads[k] for k in grads}
                theta = {k: (theta[k] - ctx.client_lr * buf[k]).detach() for k in theta}
            buffers[int(i)], expected[int(i)] = buf, theta
        sim.run_round(t)
        for i, theta in expected.items():
            for k, v in local_model(sim, i).items():
                torch.testing.assert_close(v, theta[k], rtol=1e-9, atol=1e-11)
    assert any(k.startswith("opt.") for k in sim.store.tensors) == keep


def test_exact_and_mean_a_gradients_differ():
    rows = {}
    for kind in ("exact", "mean"):
        sim = simulation(alpha_gradient=kind)
        for t in range(2):
            sim.run_round(t)
        rows[kind] = sim.server["pgfed"]["A"]
    assert not torch.allclose(rows["exact"], rows["mean"])


def test_nonnegative_projects_a_after_the_round():
    sims = {flag: simulation(lam=50.0, nonnegative=flag) for flag in (True, False)}
    for sim in sims.values():
        for t in range(2):
            sim.run_round(t)
    free, projected = sims[False].server["pgfed"]["A"], sims[True].server["pgfed"]["A"]
    assert (free < 0).any()
    torch.testing.assert_close(projected, free.clamp(min=0))


def test_pgfedmo_with_beta_zero_is_pgfed():
    sims = [simulation("pgfed"), simulation("pgfedmo", beta=0.0)]
    for sim in sims:
        for t in range(3):
            sim.run_round(t)
    a, b = (sim.server for sim in sims)
    for k, v in a["params"].items():
        torch.testing.assert_close(b["params"][k], v, rtol=0, atol=0)
    torch.testing.assert_close(b["pgfed"]["A"], a["pgfed"]["A"], rtol=0, atol=0)
    for k, v in sims[0].store.tensors.items():
        torch.testing.assert_close(sims[1].store.tensors[k], v, rtol=0, atol=0)


def test_pgfedmo_descends_the_momentum_of_its_auxiliary_gradients():
    beta = 0.6
    sim = simulation("pgfedmo", beta=beta)
    sim.run_round(0)
    ctx, cohort = sim.context(1), sim.cohort(1)
    inputs = sim.round_inputs(1, cohort)
    downlink = sim.one_downlink(sim.downlink(ctx, cohort), int(cohort[0]), 0)
    assert float(downlink["aux_valid"]) == 1.0
    state = sim.algorithm.init_client(downlink, torch.Generator().manual_seed(0), ctx)
    old = {k: torch.randn_like(v) for k, v in state.items() if k.startswith("aux.")}
    new = {k: downlink[k] for k in old}
    plain = PGFed(**{f.name: getattr(sim.algorithm, f.name) for f in dataclasses.fields(PGFed)})
    for seen, expected in ((0.0, new), (1.0, tree.axpy(beta, old, tree.scale(new, 1 - beta)))):
        before = {**state, **old, "aux_seen": torch.tensor(seen, dtype=torch.float64)}
        out, after = sim.algorithm.client_update(downlink, before, inputs.client(0), ctx)
        for k, v in expected.items():
            torch.testing.assert_close(after[k], v)
        assert float(after["aux_seen"]) == 1.0
        # The model trained along that auxiliary gradient: PGFed given it as its download.
        reference, _ = plain.client_update({**downlink, **expected}, before, inputs.client(0), ctx)
        for k, v in reference.upload.items():
            torch.testing.assert_close(out.upload[k], v)
    # The first round's download is empty: it is not remembered as a previous auxiliary gradient.
    fresh = simulation("pgfedmo", beta=beta)
    first = fresh.one_downlink(fresh.downlink(fresh.context(0), fresh.cohort(0)), 0, 0)
    assert float(first["aux_valid"]) == 0.0


def test_pgfedmo_momentum_changes_the_result():
    sims = {beta: simulation("pgfedmo", beta=beta) for beta in (0.0, 0.5)}
    for sim in sims.values():
        for t in range(4):
            sim.run_round(t)
    assert float(sims[0.5].store.tensors["aux_seen"].sum()) > 0
    assert not torch.allclose(sims[0.0].server["pgfed"]["A"], sims[0.5].server["pgfed"]["A"])


@pytest.mark.parametrize("client_lr", [0.0, 0.1])
def test_pgfed_ce_equals_pgfed_when_the_local_model_stays_the_global_one(client_lr):
    sim = simulation()
    sim.run_round(0)
    ctx = dataclasses.replace(sim.context(1), client_lr=client_lr)
    cohort = sim.cohort(1)
    downlink = sim.downlink(ctx, cohort)
    states, inputs = sim.states(cohort, downlink, ctx), sim.round_inputs(1, cohort)
    fields = {f.name: getattr(sim.algorithm, f.name) for f in dataclasses.fields(PGFed)}
    algorithms = {"pgfed": sim.algorithm, "ce": PGFedCE(**fields)}
    servers = {}
    for name, algorithm in algorithms.items():
        out, _ = loop_backend(algorithm, downlink, states, inputs, ctx)
        servers[name] = algorithm.server_round(sim.server, out, ctx, torch.as_tensor(cohort))
    same = torch.allclose(servers["pgfed"]["pgfed"]["A"], servers["ce"]["pgfed"]["A"])
    assert same == (client_lr == 0.0)
    assert not torch.allclose(servers["ce"]["pgfed"]["A"], sim.server["pgfed"]["A"])


def test_pgfed_ce_uploads_no_iterates():
    sims = {name: simulation(name) for name in ("pgfed", "pgfed-ce")}
    keys = {}
    for name, sim in sims.items():
        ctx, cohort = sim.context(0), sim.cohort(0)
        downlink = sim.downlink(ctx, cohort)
        out, _ = loop_backend(
            sim.algorithm,
            downlink,
            sim.states(cohort, downlink, ctx),
            sim.round_inputs(0, cohort),
            ctx,
        )
        keys[name] = set(out.upload)
    extra = keys["pgfed"] - keys["pgfed-ce"]
    assert extra and all(k.startswith("iterates.") for k in extra)


def test_unseen_clients_fine_tune_the_global_model():
    sim = Simulation(
        ragged_experiment("pgfed", unseen_fraction=0.34, options={"join_epochs": 3.0}), None
    )
    sim.run_round(0)
    record = sim.evaluate(1)
    assert "unseen_test_acc" in record
    # join: join_epochs epochs of plain SGD on the local risk, from the global model.
    ctx = sim.context(1)
    payload = sim.algorithm.downlink(sim.server, ctx)
    state = sim.algorithm.init_client(payload, torch.Generator(), ctx)
    personal = sim.personalization(1, unseen=True)
    data = personal.inputs(np.array([0]))
    one = torch.utils._pytree.tree_map(lambda t: t[0], data)
    assert one.batches.shape[0] == 3  # full batch: one step per epoch
    joined = sim.algorithm.join(payload, state, one, ctx)
    aux = {k: torch.zeros_like(v) for k, v in sim.server["params"].items()}
    expected, _ = reference_trajectory(sim, dict(sim.server["params"]), aux, one, ctx.client_lr)
    for k, v in expected.items():
        torch.testing.assert_close(joined[f"local.{k}"], v)


@pytest.mark.parametrize("name", ["pgfed", "pgfedmo", "pgfed-ce"])
def test_evaluation_predicts_with_theta_alone(name):
    """Evaluation's downlink leaves out every client's g~_i (training reads it, prediction does
    not): the same rows as with the round's downlink."""
    sim = simulation(name)
    for t in range(2):
        sim.run_round(t)
    ctx, ids = sim.context(2), np.arange(sim.exp.data.num_clients)
    lean = sim.downlink(ctx, ids, evaluation=True)
    full = sim.downlink(ctx, ids)
    assert set(lean) == set(sim.server["params"]) < set(full)
    columns = {
        kind: metrics.evaluate_clients(
            sim.algorithm,
            lambda i, d=downlink: {k: v[i] for k, v in d.items()},
            sim.store.read(ids),
            sim.pools,
        )  # fmt: skip
        for kind, downlink in (("lean", lean), ("full", full))
    }
    for key, value in columns["full"].items():
        np.testing.assert_array_equal(columns["lean"][key], value, err_msg=key)
    # unseen clients start (init_client) and join from theta alone too
    unseen = Simulation(
        ragged_experiment(name, unseen_fraction=0.34, options={"join_epochs": 1.0}), None
    )
    unseen.run_round(0)
    record = unseen.evaluate(1)
    assert np.isfinite(record["unseen_test_acc"]) and np.isfinite(record["unseen_train_loss"])


def test_bad_options_are_config_errors():
    with pytest.raises(ConfigError, match="alpha_gradient"):
        simulation(alpha_gradient="median")
    with pytest.raises(ConfigError, match="beta"):
        simulation("pgfedmo", beta=1.0)
