"""The domain-generalization methods (FedSR, FedIIR, ADCOL, Floco): each defining update against
a hand-written float64 reference.

The references use only torch autograd on the MLP written out by hand (``test_classic``'s
``features`` / ``logits``; no library training loop, loss, tree algebra or optimizer) and run
client by client on the ragged clients of ``test_fast_sim`` (sizes 3..14, one to three classes
each) with partial participation; with ``local_epochs`` and a batch size the clients take
different numbers of local steps. The library runs the real round loop (vmap backend) and the
two must agree to rounding. Random draws (FedSR's eps) are inputs: the reference reads them from
the library's counter-based generator with the key it finds in the client's state.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from sklearn.decomposition import PCA
from test_classic import (
    EPOCHS,
    LR,
    assert_close,
    ce,
    descend,
    features,
    gradient,
    logits,
    round_inputs,
    steps_of,
)
from test_fast_sim import ragged_experiment

from pflego.algorithms.floco import pca
from pflego.rng import counter_normal, counter_uniform, first_visit_generator
from pflego.sim import Simulation


def index_steps(data) -> list[torch.Tensor]:
    """The sample indices of every real step of one client's unpadded schedule."""
    return [row[m > 0] for row, m in zip(data.batches, data.batch_mask, strict=True) if m.sum() > 0]


def weighted_mean(models: list[dict], sizes: list[float]) -> dict:
    return {
        k: sum(n * w[k] for n, w in zip(sizes, models, strict=True)) / sum(sizes) for k in models[0]
    }


def test_counter_normal_draws_are_standard_normal_and_the_same_under_vmap():
    n = torch.arange(200_000)
    z = counter_normal(torch.tensor(7), n)
    assert abs(float(z.mean())) < 0.01 and abs(float(z.std()) - 1) < 0.01
    assert abs(float((z > 1.96).double().mean()) - 0.025) < 0.002
    assert torch.equal(z, counter_normal(torch.tensor(7), n))  # a pure function of its keys
    assert not torch.equal(z[:100], counter_normal(torch.tensor(8), n[:100]))
    keys = torch.tensor([3, 4, 5])
    batched = torch.func.vmap(lambda k: counter_normal(k, n[:10]))(keys)
    torch.testing.assert_close(batched, torch.stack([counter_normal(k, n[:10]) for k in keys]))


# --- FedSR ------------------------------------------------------------------------------------

L2R, CMI = 0.05, 0.02


def gaussian(p: dict, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """mu(x) and sigma(x): the map after the body split in halves, softplus + 1e-6 on the second."""
    out = features(p, x) @ p["sr.map.weight"].T + p["sr.map.bias"]
    m = out.shape[1] // 2
    return out[:, :m], F.softplus(out[:, m:]) + 1e-6


def fedsr_loss(eps: torch.Tensor):
    """CE(h(mu + sigma eps)) + L2R mean ||z||^2 + CMI mean KL(N(mu, sigma) || N(r_mu_y, r_sigma_y))"""

    def loss(p, x, y, rows):
        mu, sigma = gaussian(p, x)
        z = mu + sigma * eps[rows]
        total = F.cross_entropy(z @ p["head.weight"].T + p["head.bias"], y)
        for s in range(len(y)):
            r_mu = p["sr.r_mu"][y[s]]
            r_sigma = F.softplus(p["sr.r_sigma"][y[s]]) + 1e-6
            kl = (
                torch.log(r_sigma / sigma[s])
                + (sigma[s] ** 2 + (mu[s] - r_mu) ** 2) / (2 * r_sigma**2)
                - 0.5
            ).sum()
            total = total + (L2R * (z[s] ** 2).sum() + CMI * kl) / len(y)
        return total

    return loss


def test_fedsr_trains_a_probabilistic_representation_with_l2_and_cmi_terms():
    sim = Simulation(ragged_experiment("fedsr", options={"l2r": L2R, "cmi": CMI}, **EPOCHS), None)
    seen: set[int] = set()
    revisits, keys = 0, set()
    for t in range(3):
        cohort, w, clients = round_inputs(sim, t)
        ctx = sim.context(t)
        before = {  # each client's key of eps: stored, or drawn at its first visit
            i: sim.store.get(i)["key"].clone()
            if i in seen
            else sim.algorithm.init_client(w, first_visit_generator(0, i), ctx)["key"]
            for i in cohort
        }
        sim.run_round(t)
        trained, sizes = [], []
        for i, data in zip(cohort, clients, strict=True):
            revisits += i in seen
            seen.add(i)
            key = before[i]
            keys.add(float(key))
            assert float(sim.store.get(i)["key"]) != float(key)  # a new key for the next round
            n, m = len(data.y), sim.algorithm.model.feature_dim
            rows, cols = torch.arange(n)[:, None], torch.arange(m)[None]
            eps = counter_normal(key, rows, cols, dtype=torch.float64)
            p = {k: v.clone() for k, v in w.items()}
            for idx in index_steps(data):
                g = gradient(fedsr_loss(eps), p, data.x[idx], data.y[idx], idx)
                p = {k: v - LR * g[k] for k, v in p.items()}
            trained.append(p)
            sizes.append(float(n))
        assert_close(sim.server["params"], weighted_mean(trained, sizes))
    assert len(keys) > len(seen)  # clients draw their own eps, new ones every round
    assert revisits > 0
    # prediction: the head on the mean representation
    downlink = sim.algorithm.downlink(sim.server, sim.context(3))
    x = torch.randn(5, 1, 3, 3, dtype=torch.float64)
    mu, _ = gaussian(downlink, x)
    torch.testing.assert_close(
        sim.algorithm.predict(downlink, sim.store.get(cohort[0]), x),
        mu @ downlink["head.weight"].T + downlink["head.bias"],
    )


# --- FedIIR -----------------------------------------------------------------------------------

GAMMA, BETA = 0.5, 0.6
HEAD = ("head.weight", "head.bias")


def head_gradient(p: dict, x: torch.Tensor, y: torch.Tensor, create_graph: bool) -> dict:
    """grad_w of the mean cross-entropy, w the head, by autograd."""
    grads = torch.autograd.grad(ce(p, x, y), [p[k] for k in HEAD], create_graph=create_graph)
    return dict(zip(HEAD, grads, strict=True))


def fediir_loss(gbar: dict):
    """CE + gamma ||grad_w CE - g_bar||^2 on the minibatch."""

    def loss(p, x, y):
        g = head_gradient(p, x, y, create_graph=True)
        return ce(p, x, y) + GAMMA * sum(((g[k] - gbar[k]) ** 2).sum() for k in HEAD)

    return loss


def test_fediir_aligns_classifier_gradients_with_the_moving_average_of_the_cohorts():
    options = {"penalty": GAMMA, "ema": BETA}
    sim = Simulation(ragged_experiment("fediir", options=options, **EPOCHS), None)
    gbar = None
    for t in range(4):
        cohort, w, clients = round_inputs(sim, t)
        w = {k: v for k, v in w.items() if not k.startswith("gbar")}
        if gbar is None:
            gbar = {k: torch.zeros_like(w[k]) for k in HEAD}
        trained, grads, sizes = [], [], []
        for data in clients:
            leaves = {k: v.clone().requires_grad_(True) for k, v in w.items()}
            grads.append(
                {k: v.detach() for k, v in head_gradient(leaves, data.x, data.y, False).items()}
            )
            trained.append(descend(w, fediir_loss(gbar), steps_of(data)))
            sizes.append(float(len(data.y)))
        sim.run_round(t)
        assert_close(sim.server["params"], weighted_mean(trained, sizes))
        mean = weighted_mean(grads, sizes)
        gbar = {k: BETA * gbar[k] + (1 - BETA) * mean[k] for k in HEAD}
        assert_close(sim.server["gbar"], gbar)
    assert float(gbar["head.weight"].abs().max()) > 1e-3
    z = torch.randn(4, 1, 3, 3, dtype=torch.float64)  # prediction: the plain global logits
    downlink = sim.algorithm.evaluation_downlink(sim.server, sim.context(4))
    torch.testing.assert_close(
        sim.algorithm.predict(downlink, {}, z), logits(sim.server["params"], z)
    )


# --- ADCOL ------------------------------------------------------------------------------------

MU_ADCOL, DIS_LR = 0.7, 0.3


def party_logits(d: dict, z: torch.Tensor) -> torch.Tensor:
    """The discriminator, written out: Linear -> ReLU -> Linear -> ReLU -> Linear."""
    h = torch.relu(z @ d["0.weight"].T + d["0.bias"])
    h = torch.relu(h @ d["1.weight"].T + d["1.bias"])
    return h @ d["2.weight"].T + d["2.bias"]


def adcol_loss(d: dict, classes: int):
    """CE over the party's own classes + mu KL(uniform || softmax(D(f(x)))), batch mean."""

    def loss(p, x, y):
        value = F.cross_entropy(logits(p, x)[:, :classes], y)
        p_party = torch.softmax(party_logits(d, features(p, x)), -1)
        u = torch.full_like(p_party, 1 / p_party.shape[-1])
        kl = (u * (torch.log(u) - torch.log(p_party))).sum(-1)
        return value + MU_ADCOL * kl.mean()

    return loss


def test_adcol_trains_own_models_against_a_discriminator_of_parties():
    sim = Simulation(
        ragged_experiment("adcol", options={"mu": MU_ADCOL, "dis_lr": DIS_LR}, **EPOCHS), None
    )
    population = sim.exp.data.num_clients
    models: dict[int, dict] = {}
    for t in range(4):
        cohort, w0, clients = round_inputs(sim, t)
        d = {
            k: v.clone() for k, v in sim.algorithm.discriminator(sim.server, sim.context(t)).items()
        }
        assert d["2.weight"].shape[0] == population
        grads, sizes = [], []
        for i, data in zip(cohort, clients, strict=True):
            classes = int(data.label_mask.sum())
            w = descend(models.get(i, w0), adcol_loss(d, classes), steps_of(data))
            models[i] = w
            leaves = {k: v.clone().requires_grad_(True) for k, v in d.items()}
            z = features(w, data.x).detach()
            target = torch.full((len(data.y),), i)
            own = F.cross_entropy(party_logits(leaves, z), target)
            grads.append(dict(zip(d, torch.autograd.grad(own, list(leaves.values())), strict=True)))
            sizes.append(float(len(data.y)))
        sim.run_round(t)
        mean = weighted_mean(grads, sizes)
        assert_close(sim.server["disc"], {k: v - DIS_LR * mean[k] for k, v in d.items()})
        assert_close(sim.server["params"], w0)  # w^0 never moves
        for i in cohort:
            assert_close(sim.store.get(i), models[i])
    # prediction: the party's own model
    downlink = sim.algorithm.send(sim.server, sim.context(4), torch.tensor([cohort[0]]), True)
    x = torch.randn(5, 1, 3, 3, dtype=torch.float64)
    state = sim.store.get(cohort[0])
    torch.testing.assert_close(
        sim.algorithm.predict(downlink.of(0), state, x), logits(models[cohort[0]], x)
    )
    # a newcomer trains its own model from w^0 against the current D
    newcomer = sim.algorithm.downlink(sim.server, sim.context(4))
    data = clients[0]
    joined = sim.algorithm.join(
        newcomer, sim.algorithm.init_client(newcomer, None, None), data, sim.context(4)
    )
    d = sim.server["disc"]
    assert_close(joined, descend(w0, adcol_loss(d, int(data.label_mask.sum())), steps_of(data)))


# --- Floco ------------------------------------------------------------------------------------

M_ENDPOINTS, TAU, RHO = 3, 2, 0.3


def floco_alphas(key, n: int, beta=None) -> torch.Tensor:
    """Each sample's alpha: normalized exponentials (Dirichlet(1)) before the placement, beta plus
    a radius U(0, rho) times a direction v / |v|_1, v ~ U(-1, 1)^m, after."""
    rows, cols = torch.arange(n)[:, None], torch.arange(M_ENDPOINTS)[None]
    if beta is None:
        e = -torch.log(counter_uniform(key, rows, cols))
        return e / e.sum(1, keepdim=True)
    v = 2 * counter_uniform(key, rows, cols + M_ENDPOINTS) - 1
    r = RHO * counter_uniform(key, rows, torch.tensor(2 * M_ENDPOINTS))
    return beta + r * v / v.abs().sum(1, keepdim=True)


def simplex_logits(p: dict, x: torch.Tensor, alpha: torch.Tensor) -> torch.Tensor:
    """Per sample, features @ (sum_k alpha_k W_k)^T + b."""
    f = features(p, x)
    rows = []
    for s in range(len(f)):
        w = sum(alpha[s, k] * p["simplex.weight"][k] for k in range(M_ENDPOINTS))
        rows.append(w @ f[s] + p["head.bias"])
    return torch.stack(rows)


def placement(signals: np.ndarray) -> np.ndarray:
    """scikit-learn's exact PCA to m components, projected onto the simplex scaled by z (the
    sort-based algorithm), renormalized; z of lowest mean 1/d^2 over pairs (d floored at 1e-4)."""
    kappa = PCA(n_components=M_ENDPOINTS, svd_solver="full").fit_transform(signals)
    best, lowest = None, np.inf
    for z in np.linspace(1e-4, 1, 1000):
        beta = np.empty_like(kappa)
        for i, v in enumerate(kappa):
            u = np.sort(v)[::-1]
            cumulative = np.cumsum(u) - z
            count = max(j + 1 for j in range(len(u)) if u[j] - cumulative[j] / (j + 1) > 0)
            beta[i] = np.maximum(v - cumulative[count - 1] / count, 0)
        beta /= beta.sum(1, keepdims=True)
        pairs = [(a, b) for a in range(len(beta)) for b in range(a + 1, len(beta))]
        d = np.array([max(np.linalg.norm(beta[a] - beta[b]), 1e-4) for a, b in pairs])
        energy = np.log((1 / d**2).sum()) - np.log(len(pairs))
        if energy < lowest:
            best, lowest = beta, energy
    return best


def test_floco_pca_fixes_each_axis_sign_by_its_largest_entry():
    """The placement is deterministic because PCA's signs are fixed, as scikit-learn's PCA (since
    1.5) fixes them: each principal axis has its largest entry (in magnitude) positive, whatever
    signs the SVD returned."""
    rows = torch.randn(5, 8, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    kappa = pca(rows, 4)
    centred = rows - rows.mean(0)  # of rank 4
    for k in range(4):
        axis = centred.T @ kappa[:, k] / kappa[:, k].square().sum()  # kappa_k = centred @ axis
        torch.testing.assert_close(centred @ axis, kappa[:, k])
        torch.testing.assert_close(axis.norm(), torch.tensor(1.0, dtype=torch.float64))
        assert axis[axis.abs().argmax()] > 0, k


def test_floco_trains_simplex_subregions_placed_by_the_clients_updates():
    options = {"endpoints": M_ENDPOINTS, "tau": TAU, "rho": RHO}
    sim = Simulation(ragged_experiment("floco", options=options, **EPOCHS), None)
    population = sim.exp.data.num_clients
    seen: set[int] = set()
    signals: dict[int, torch.Tensor] = {}
    betas = None
    for t in range(4):
        cohort, w, clients = round_inputs(sim, t)
        ctx = sim.context(t)
        before = {
            i: sim.store.get(i)["key"].clone()
            if i in seen
            else sim.algorithm.init_client(w, first_visit_generator(0, i), ctx)["key"]
            for i in cohort
        }
        sim.run_round(t)
        trained, sizes = [], []
        for i, data in zip(cohort, clients, strict=True):
            seen.add(i)
            beta = None if betas is None else torch.from_numpy(betas[i])
            alpha = floco_alphas(before[i], len(data.y), beta)

            def loss(p, x, y, idx, alpha=alpha):
                return F.cross_entropy(simplex_logits(p, x, alpha[idx]), y)

            p = {k: v.clone() for k, v in w.items()}
            for idx in index_steps(data):
                g = gradient(loss, p, data.x[idx], data.y[idx], idx)
                p = {k: v - LR * g[k] for k, v in p.items()}
            trained.append(p)
            sizes.append(float(len(data.y)))
            signals[i] = (w["simplex.weight"] - p["simplex.weight"]).flatten()
        assert_close(sim.server["params"], weighted_mean(trained, sizes))
        if t == TAU - 1:  # placement: each trained client's point, the others at the centre
            placed = sorted(signals)
            betas = np.full((population, M_ENDPOINTS), 1 / M_ENDPOINTS)
            betas[placed] = placement(torch.stack([signals[i] for i in placed]).numpy())
            assert len(placed) < population  # a client never trained before the placement
        expected = betas if betas is not None else np.full((population, M_ENDPOINTS), 1 / 3)
        np.testing.assert_allclose(
            sim.server["floco"]["beta"].numpy(), expected, rtol=1e-9, atol=1e-12
        )
    assert len({tuple(np.round(b, 6)) for b in betas}) > 2  # the clients are spread
    # prediction: the client's own point of the simplex
    i = cohort[0]
    downlink = sim.algorithm.send(sim.server, sim.context(4), torch.tensor([i]), True).of(0)
    x = torch.randn(5, 1, 3, 3, dtype=torch.float64)
    point = torch.from_numpy(betas[i]).expand(5, -1)
    torch.testing.assert_close(
        sim.algorithm.predict(downlink, sim.store.get(i), x),
        simplex_logits(sim.server["params"], x, point),
    )
    # a client that never trained was never placed: the simplex's centre
    newcomer = sim.algorithm.downlink(sim.server, sim.context(4))
    centre = torch.full((5, M_ENDPOINTS), 1 / M_ENDPOINTS, dtype=torch.float64)
    torch.testing.assert_close(
        sim.algorithm.predict(newcomer, {}, x), simplex_logits(sim.server["params"], x, centre)
    )
