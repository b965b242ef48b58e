"""pFedMe and Per-FedAvg: their defining updates against hand-written float64 references."""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from test_fast_sim import BACKS, SIZES, assert_trees_close, ragged_experiment

from pflego.algorithms.pfedme import PFedMe
from pflego.errors import ConfigError
from pflego.models import build_model
from pflego.sim import Simulation
from pflego.types import ClientData, RoundContext

CTX = RoundContext(0, 1, 1.0, 1, 0.1, 1.0)


# --- pFedMe: the inner solve ------------------------------------------------------------------


@dataclass(frozen=True)
class LeastSquaresPFedMe(PFedMe):
    """pFedMe on f(theta) = 1/(2n) ||X theta - y||^2, whose proximal point has a closed form."""

    def loss(self, params, x, y, mask, label_mask):
        residual = x @ params["w"] - y
        return 0.5 * (mask * residual**2).sum() / mask.sum()


def least_squares_client(n: int = 12, d: int = 5) -> ClientData:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(n, d, generator=gen, dtype=torch.float64)
    y = torch.randn(n, generator=gen, dtype=torch.float64)
    ones = torch.ones(n, dtype=torch.float64)
    return ClientData(
        x, y, ones, torch.arange(n)[None], ones[None], ones[:1], torch.tensor(float(n))
    )


def test_inner_solve_converges_to_the_moreau_envelope_minimizer_as_k_grows():
    data = least_squares_client()
    lam, n, d = 2.0, *data.x.shape
    w = {"w": torch.linspace(-1, 1, d, dtype=torch.float64)}
    # argmin f(theta) + lam/2 ||theta - w||^2  solves  (X^T X / n + lam I) theta = X^T y / n + lam w
    exact = torch.linalg.solve(
        data.x.T @ data.x / n + lam * torch.eye(d, dtype=torch.float64),
        data.x.T @ data.y / n + lam * w["w"],
    )
    model = build_model("linear", (d,), 1, 1)
    errors = []
    for k in (1, 4, 16, 64):
        alg = LeastSquaresPFedMe(model=model, lam=lam, K=k, personal_lr=0.2)
        (batch,) = alg.minibatches(data)
        theta, _ = alg.personal_solve(dict(w), w, batch)
        errors.append(float((theta["w"] - exact).norm()))
    assert all(b < 0.5 * a for a, b in itertools.pairwise(errors))
    assert errors[-1] < 1e-12


# --- pFedMe: one round ------------------------------------------------------------------------


def pfedme_reference(model, w, data: ClientData, lam, k, personal_lr, eta, weight_decay):
    """Algorithm 1's local iterations for one client, written with torch.autograd."""
    local = {n: v.clone() for n, v in w.items()}
    theta = {n: v.clone() for n, v in w.items()}
    for idx, mask in zip(data.batches, data.batch_mask):
        rows = idx[mask > 0]
        if len(rows) == 0:
            continue
        x, y = data.x[rows], data.y[rows]
        for _ in range(k):
            leaves = {n: v.detach().requires_grad_(True) for n, v in theta.items()}
            loss = F.cross_entropy(model.forward(leaves, x), y)
            loss = loss + lam / 2 * sum(((leaves[n] - local[n]) ** 2).sum() for n in leaves)
            loss = loss + weight_decay / 2 * sum((v**2).sum() for v in leaves.values())
            grads = torch.autograd.grad(loss, list(leaves.values()))
            theta = {n: v.detach() - personal_lr * g for (n, v), g in zip(leaves.items(), grads)}
        local = {n: local[n] - eta * lam * (local[n] - theta[n]) for n in local}
    return local, theta


@pytest.mark.parametrize(
    ("beta", "weights", "weight_decay"), [(1.0, "uniform", 0.0), (2.0, "samples", 1e-3)]
)
def test_one_round_is_algorithm_1_with_beta_mixing(beta, weights, weight_decay):
    options = {"lam": 15.0, "K": 3, "personal_lr": 0.02, "beta": beta, "weights": weights}
    sim = Simulation(
        ragged_experiment(
            "pfedme", batch_size=4, client_lr=0.03, weight_decay=weight_decay, options=options
        ),
        None,
    )
    ctx, cohort = sim.context(0), sim.cohort(0)
    inputs = sim.round_inputs(0, cohort)
    w = {k: v.clone() for k, v in sim.server["params"].items()}
    refs = [
        pfedme_reference(
            sim.algorithm.model, w, inputs.client(c), 15.0, 3, 0.02, 0.03, weight_decay
        )
        for c in range(len(cohort))
    ]
    sizes = torch.as_tensor(inputs.sizes, dtype=torch.float64)
    share = sizes / sizes.sum() if weights == "samples" else torch.full_like(sizes, 1 / len(sizes))
    mean_local = {k: sum(s * local[k] for s, (local, _) in zip(share, refs)) for k in w}
    sim.run_round(0)
    for k, v in sim.server["params"].items():
        torch.testing.assert_close(v, (1 - beta) * w[k] + beta * mean_local[k], rtol=0, atol=1e-12)
        if beta == 1.0:  # plain averaging of the w_i
            torch.testing.assert_close(v, mean_local[k], rtol=0, atol=1e-12)
        for c, i in enumerate(cohort):  # theta_i is the client's state
            torch.testing.assert_close(sim.store.tensors[k][i], refs[c][1][k], rtol=0, atol=1e-12)
    assert ctx.seed == sim.cfg.seed


def test_every_client_trains_and_the_server_mixes_a_uniform_sample():
    options = {"sampled": 2, "beta": 2.0}
    sim = Simulation(ragged_experiment("pfedme", participation=1.0, options=options), None)
    picks = []
    for t in range(4):
        ctx, cohort = sim.context(t), sim.cohort(t)
        assert len(cohort) == len(SIZES)  # Algorithm 1: all clients run their local iterations
        downlink = sim.algorithm.downlink(sim.server, ctx)
        out, states = BACKS["loop"](
            sim.algorithm,
            downlink,
            sim.states(cohort, downlink, ctx),
            sim.round_inputs(t, cohort),
            ctx,
        )
        sim.run_round(t)
        for k in states:  # every client's theta is fresh, mixed or not
            torch.testing.assert_close(sim.store.tensors[k], states[k], rtol=0, atol=1e-12)
        matches = [
            pair
            for pair in itertools.combinations(range(len(cohort)), 2)
            if all(
                torch.allclose(
                    sim.server["params"][k],
                    downlink[k] - 2.0 * out.upload[k][list(pair)].mean(0),
                    rtol=0,
                    atol=1e-12,
                )
                for k in downlink
            )
        ]
        assert len(matches) == 1
        picks.append(matches[0])
    assert len(set(picks)) > 1  # a fresh draw each round
    again = Simulation(ragged_experiment("pfedme", participation=1.0, options=options), None)
    for t in range(4):
        again.run_round(t)
    assert_trees_close(again.server["params"], sim.server["params"], atol=0)


def test_global_and_personal_models_are_both_evaluated_and_join_is_the_personal_solve():
    options = {"lam": 15.0, "K": 2, "personal_lr": 0.05}
    sim = Simulation(
        ragged_experiment("pfedme", batch_size=4, unseen_fraction=0.34, options=options), None
    )
    sim.run_round(0)
    record = sim.evaluate(1)  # first-visit states (theta = w) of the clients not yet sampled
    assert {"test_acc", "test_acc_global", "unseen_test_acc"} <= record.keys()
    assert record["test_loss"] != record["test_loss_global"]
    before = {k: v.clone() for k, v in sim.store.tensors.items()}
    assert sim.evaluate(1) == record
    assert_trees_close(sim.store.tensors, before, atol=0)  # evaluation never stores anything
    # join: the proximal solve around the received w, i.e. Algorithm 1 with w_i held (eta = 0)
    ctx = sim.context(1)
    w = sim.algorithm.downlink(sim.server, ctx)
    data = sim.personalization(1, unseen=True).inputs(np.array([0]))
    one = torch.utils._pytree.tree_map(lambda t: t[0], data)
    joined = sim.algorithm.join(w, {}, one, ctx)
    _, theta = pfedme_reference(sim.algorithm.model, w, one, 15.0, 2, 0.05, 0.0, 0.0)
    assert_trees_close({k: joined[k] for k in w}, theta, atol=1e-12)
    assert not all(torch.allclose(theta[k], w[k]) for k in w)
    assert float(joined["personalized"]) == 1.0
    # a client that never trained is evaluated with the current global model (its PM's logits
    # come from the vmapped models, the GM's from one pooled pass: equal up to rounding)
    _, rows = sim_rows(sim)
    visited = sim.store.visited.numpy()
    assert 0 < visited.sum() < len(visited)
    for row, trained in zip(rows, visited):
        assert (row["test_loss"] == pytest.approx(row["test_loss_global"], rel=1e-14)) != trained


def test_bad_pfedme_options_are_config_errors():
    with pytest.raises(ConfigError, match="weights"):
        ragged_experiment("pfedme", options={"weights": "size"})
    with pytest.raises(ConfigError, match="lam"):
        ragged_experiment("pfedme", options={"lam": 0.0})


# --- Per-FedAvg -------------------------------------------------------------------------------


def flat_objective(model, shapes, x, y, weight_decay):
    """f(w; D) of a flat parameter vector, for an explicit Hessian."""

    def f(flat):
        params, start = {}, 0
        for name, shape in shapes.items():
            size = int(np.prod(shape))
            params[name] = flat[start : start + size].reshape(shape)
            start += size
        loss = F.cross_entropy(model.forward(params, x), y)
        return loss + weight_decay / 2 * (flat**2).sum()

    return f


def real_rows(data: ClientData, idx, mask):
    rows = idx[mask > 0]
    return data.x[rows], data.y[rows]


def flatten(params) -> torch.Tensor:
    return torch.cat([v.reshape(-1) for v in params.values()])


def batch_objectives(model, w, data: ClientData, weight_decay: float = 0.0) -> list:
    """f(.; D_k) of a flat vector for each minibatch D_k of the client's meta schedule."""
    shapes = {k: v.shape for k, v in w.items()}
    idx, mask = data.schedules["meta"]
    assert bool((mask.sum(1) > 0).all())
    return [
        flat_objective(model, shapes, *real_rows(data, i, m), weight_decay)
        for i, m in zip(idx, mask)
    ]


def perfedavg_reference(model, w, data: ClientData, alpha, beta, weight_decay, hessian: bool):
    """R meta-steps with the explicit Hessian (HF) or without it (FO), on flat vectors."""
    flat, fs = flatten(w), batch_objectives(model, w, data, weight_decay)
    m = 3 if hessian else 2
    assert len(fs) % m == 0
    for group in range(len(fs) // m):
        f = fs[group * m : group * m + m]
        g = torch.func.grad(f[1])(flat - alpha * torch.func.grad(f[0])(flat))
        if hessian:
            g = g - alpha * torch.autograd.functional.hessian(f[2], flat) @ g
        flat = flat - beta * g
    return flat


@pytest.mark.parametrize("variant", ["fo", "hf"])
def test_perfedavg_meta_steps_match_the_explicit_hessian_reference(variant):
    alpha, beta, decay = 0.3, 0.2, 0.01
    sim = Simulation(
        ragged_experiment(
            "perfedavg",
            model="mlp5",
            batch_size=4,
            inner_steps=2,
            client_lr=beta,
            weight_decay=decay,
            options={"alpha": alpha, "variant": variant},
        ),
        None,
    )
    ctx, cohort = sim.context(0), sim.cohort(0)
    inputs = sim.round_inputs(0, cohort)
    w = sim.algorithm.downlink(sim.server, ctx)
    out, _ = BACKS["vmap"](sim.algorithm, w, {}, inputs, ctx)
    for c in range(len(cohort)):
        data = inputs.client(c)
        if int(data.num_samples) < 8:  # only clients whose meta-batches are all real minibatches
            continue
        expected = perfedavg_reference(
            sim.algorithm.model, w, data, alpha, beta, decay, variant == "hf"
        )
        upload = flatten({k: v[c] for k, v in out.upload.items()})
        torch.testing.assert_close(upload, flatten(w) - expected, rtol=0, atol=1e-12)


def one_meta_step(variant: str, alpha: float, beta: float):
    """The largest client's upload after one meta-step, its w and its minibatch objectives."""
    sim = Simulation(
        ragged_experiment(
            "perfedavg",
            model="mlp5",
            batch_size=4,
            inner_steps=1,
            client_lr=beta,
            options={"alpha": alpha, "variant": variant},
        ),
        None,
    )
    ctx, cohort = sim.context(0), sim.cohort(0)
    inputs = sim.round_inputs(0, cohort)
    w = sim.algorithm.downlink(sim.server, ctx)
    data = inputs.client(int(np.argmax(inputs.sizes)))
    out, _ = sim.algorithm.client_update(w, {}, data, ctx)
    return flatten(out.upload), flatten(w), batch_objectives(sim.algorithm.model, w, data)


def test_first_order_drops_exactly_the_hessian_term():
    """One meta-step: HF's update minus FO's is beta * alpha * H(w; D'') g, nothing else."""
    alpha, beta = 0.3, 0.2
    fo, flat, _ = one_meta_step("fo", alpha, beta)
    hf, _, fs = one_meta_step("hf", alpha, beta)
    # FO's schedule has 2 batches and HF's 3, drawn from the same seeded shuffle: D, D' agree
    g = torch.func.grad(fs[1])(flat - alpha * torch.func.grad(fs[0])(flat))
    hessian_g = torch.autograd.functional.hessian(fs[2], flat) @ g
    torch.testing.assert_close(fo, beta * g, rtol=0, atol=1e-12)
    torch.testing.assert_close(hf - fo, -beta * alpha * hessian_g, rtol=0, atol=1e-12)
    assert float(hessian_g.norm()) > 1e-3


def test_the_authors_per_fedavg_takes_two_plain_sgd_steps():
    alpha, beta = 0.3, 0.2
    upload, flat, fs = one_meta_step("code", alpha, beta)
    stepped = flat - alpha * torch.func.grad(fs[0])(flat)
    expected = stepped - beta * torch.func.grad(fs[1])(stepped)
    torch.testing.assert_close(upload, flat - expected, rtol=0, atol=1e-12)


@pytest.mark.parametrize("options", [{"variant": "hf"}, {"variant": "code", "personalize": "code"}])
def test_perfedavg_variants_vmap_equals_loop(options):
    settings = {"batch_size": 4, "local_epochs": 1.5, "options": options}
    sims = {b: Simulation(ragged_experiment("perfedavg", **settings), None) for b in BACKS}
    for sim in sims.values():
        for t in range(2):
            sim.run_round(t)
    assert_trees_close(sims["loop"].server["params"], sims["vmap"].server["params"])
    records = {b: sim.evaluate(2) for b, sim in sims.items()}
    assert records["loop"]["test_acc"] == pytest.approx(records["vmap"]["test_acc"], abs=1e-12)


def test_perfedavg_personalizes_only_in_adapt():
    alpha = 0.5
    sim = Simulation(ragged_experiment("perfedavg", batch_size=4, options={"alpha": alpha}), None)
    sim.run_round(0)
    server = {k: v.clone() for k, v in sim.server["params"].items()}
    record = sim.evaluate(1)
    assert sim.store.tensors == {}  # no state: the personalized model is never stored
    assert_trees_close(sim.server["params"], server, atol=0)
    plain = Simulation(ragged_experiment("fedavg", batch_size=4), None)
    plain.server = {**plain.server, "params": server}
    # before adapt: the global model itself, evaluated like FedAvg's
    assert record["test_acc_before_adapt"] == pytest.approx(
        plain.evaluate(1)["test_acc"], abs=1e-12
    )
    # after adapt: one step w - alpha grad f(w; D) on the adaptation minibatch, client by client
    pool = sim.test_pool
    _, rows = sim_rows(sim)
    for i, row in enumerate(rows):
        data = torch.utils._pytree.tree_map(
            lambda t: t[0], sim.personalization(1).inputs(np.array([i]))
        )
        rows_i = data.batches[0][data.batch_mask[0] > 0]
        leaves = {k: v.clone().requires_grad_(True) for k, v in server.items()}
        loss = F.cross_entropy(sim.algorithm.model.forward(leaves, data.x[rows_i]), data.y[rows_i])
        grads = torch.autograd.grad(loss, list(leaves.values()))
        stepped = {k: v.detach() - alpha * g for (k, v), g in zip(leaves.items(), grads)}
        x, y, mask = pool.padded(np.array([i]))
        logits = sim.algorithm.model.forward(stepped, x[0][mask[0] > 0])
        acc = float((logits.argmax(-1) == y[0][mask[0] > 0]).double().mean())
        assert row["test_acc"] == pytest.approx(acc, abs=1e-12)
        assert len(rows_i) == min(4, int(data.num_samples))  # one minibatch of |D|


def sim_rows(sim: Simulation):
    from conftest import evaluate_pools

    ctx = sim.context(1)
    return evaluate_pools(
        sim.algorithm,
        sim.algorithm.downlink(sim.server, ctx),
        sim.store.tensors,
        sim.pools,
        sim.personalization(1),
    )


# --- presets ----------------------------------------------------------------------------------

PRESETS = ["pfedme-table1.yaml", "pfedme-k.yaml", "pfedme-beta.yaml"]


def row_settings(spec: dict, block: str | None, row: str) -> dict:
    """settings <- block <- row <- the block's own overrides of that row (options merged)."""
    layers = [spec["settings"]]
    if block is not None:
        own = dict(spec["blocks"][block])
        rows = own.pop("algorithms", {})
        layers += [own, spec["algorithms"][row], rows.get(row, {})]
    else:
        layers.append(spec["algorithms"][row])
    merged: dict = {"algorithm": row}
    for layer in layers:
        layer = {k: v for k, v in layer.items() if k not in ("same_run_as", "metric")}
        options = {**merged.get("options", {}), **layer.get("options", {})}
        merged |= layer
        merged["options"] = options
    return merged


@pytest.mark.parametrize("name", PRESETS)
def test_pfedme_presets_name_valid_settings(name):
    from conftest import preset

    from pflego.algorithms import build_algorithm
    from pflego.config import load_config

    spec = preset(name)
    assert spec["description"] and spec["paper"] and spec["data"] == ["mnist"]
    ((key, values),) = spec.get("sweep", {"": [None]}).items()
    for block in spec.get("blocks", [None]):
        for row, settings in spec["algorithms"].items():
            if "same_run_as" in settings:
                assert settings["same_run_as"] in spec["algorithms"]
                continue
            for value in values:
                merged = row_settings(spec, block, row)
                if key:
                    merged["options"][key.removeprefix("options.")] = value
                config = load_config(merged)
                model = build_model(config.model, (60,), 10, 10)
                alg = build_algorithm(config.algorithm, model, config.options)
                if config.algorithm == "pfedme":
                    assert config.participation == 1.0 and alg.sampled in (5, 10)
    if name == "pfedme-table1.yaml":
        assert set(spec["paper_results"]) == set(spec["blocks"])
        for results in spec["paper_results"].values():
            assert set(results) == set(spec["algorithms"]) - {"perfedavg-code"}
