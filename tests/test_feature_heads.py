"""The head, feature and prototype methods of issue 38 (FedGH, ...): each defining update, its
``predict`` and its ``join`` against a hand-written float64 reference.

The references use only torch autograd on the MLP written out by hand (``test_classic``'s
``features`` / ``logits``; no library training loop, loss, tree algebra or optimizer) and run
client by client on the ragged clients of ``test_fast_sim`` (sizes 3..14, one to three classes
each) with partial participation and ragged local steps; the library runs the real round loop.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from test_classic import (
    EPOCHS,
    LR,
    assert_close,
    features,
    gradient,
    logits,
    round_inputs,
    steps_of,
)
from test_fast_sim import ragged_experiment
from test_prototypes import descend

from pflego.sim import Simulation

C = 4  # classes of the ragged dataset
BODY = ("body.1.weight", "body.1.bias")
HEAD = ("head.weight", "head.bias")


def part(p: dict, keys) -> dict:
    return {k: p[k] for k in keys}


def ce(p, x, y):
    return F.cross_entropy(logits(p, x), y)


def new_client(sim: Simulation, t: int):
    """A first-visit state, the evaluation downlink and a client's data in round t (as for a
    client that never trained: ``join``'s inputs)."""
    ctx, cohort = sim.context(t), sim.cohort(t)
    data = sim.round_inputs(t, cohort).client(0)
    downlink = sim.algorithm.downlink(sim.server, ctx)
    return sim.init_state(int(cohort[0]), downlink, ctx), downlink, data, ctx


# --- FedGH ------------------------------------------------------------------------------------

SERVER_LR, HEAD_STEPS = 0.5, 2


def class_means(p: dict, x, y) -> dict[int, torch.Tensor]:
    z = features(p, x).detach()
    return {int(j): z[y == j].mean(0) for j in y.unique()}


def test_fedgh_trains_the_global_header_on_the_uploaded_prototypes():
    options = {"head_steps": HEAD_STEPS}
    settings = {"options": options, "server_lr": SERVER_LR, **EPOCHS}
    sim = Simulation(ragged_experiment("fedgh", **settings), None)
    f0 = {k: v.clone() for k, v in sim.server["body"].items()}
    head = {k: v.clone() for k, v in sim.server["params"].items()}
    bodies: dict[int, dict] = {}
    revisits = 0
    for t in range(4):
        cohort, start, clients = round_inputs(sim, t)
        assert_close(start, head)
        pairs = []
        for i, data in zip(cohort, clients, strict=True):
            revisits += i in bodies
            trained = descend({**bodies.get(i, f0), **head}, ce, steps_of(data))
            bodies[i] = part(trained, BODY)
            pairs += list(class_means(trained, data.x, data.y).items())
        for _ in range(HEAD_STEPS):  # the server's header on the (prototype, class) pairs
            protos = torch.stack([p for _, p in pairs])
            labels = torch.tensor([j for j, _ in pairs])
            g = gradient(
                lambda h, z, y: F.cross_entropy(z @ h["head.weight"].T + h["head.bias"], y),
                head,
                protos,
                labels,
            )
            head = {k: v - SERVER_LR * g[k] for k, v in head.items()}
        sim.run_round(t)
        assert_close(sim.server["params"], head)
        assert_close(sim.server["body"], f0)
        for i in cohort:
            assert_close(sim.store.get(i), bodies[i])
    assert revisits > 0

    # predict: the client's own extractor with the global header
    downlink = sim.algorithm.downlink(sim.server, sim.context(4))
    x = torch.randn(6, 1, 3, 3, dtype=torch.float64)
    i = cohort[0]
    torch.testing.assert_close(
        sim.algorithm.predict(downlink, sim.store.get(i), x), logits({**bodies[i], **head}, x)
    )


def test_a_new_fedgh_client_trains_its_extractor_and_predicts_with_the_global_header():
    sim = Simulation(ragged_experiment("fedgh", **EPOCHS), None)
    sim.run_round(0)
    state, downlink, data, ctx = new_client(sim, 1)
    head = part(sim.server["params"], HEAD)
    trained = descend({**part(sim.server["body"], BODY), **head}, ce, steps_of(data))
    joined = sim.algorithm.join(downlink, state, data, ctx)
    assert_close(joined, part(trained, BODY))
    torch.testing.assert_close(
        sim.algorithm.predict(downlink, joined, data.x), logits({**trained, **head}, data.x)
    )


# --- CCVR -------------------------------------------------------------------------------------

SAMPLES, BATCH, CALIBRATION_EPOCHS = 7, 5, 2


def fedavg_rounds(sim: Simulation, rounds: int) -> dict:
    """FedAvg's rounds by hand (N_i-weighted mean of the trained models)."""
    w = {k: v.clone() for k, v in sim.server["params"].items()}
    for t in range(rounds):
        cohort, start, clients = round_inputs(sim, t)
        assert_close(start, w)
        trained = [descend(w, ce, steps_of(d)) for d in clients]
        sizes = [float(len(d.y)) for d in clients]
        w = {k: sum(n * p[k] for n, p in zip(sizes, trained, strict=True)) / sum(sizes) for k in w}
        sim.run_round(t)
    return w


def class_gaussians(w: dict, clients) -> tuple[dict, dict]:
    """mu_c and Sigma_c pooled from each client's class means and unbiased covariances by the
    paper's formula (Sec. 4.2), for the classes with N_c > 1."""
    local = []  # (class, N_ck, mu_ck, Sigma_ck)
    for data in clients:
        z = features(w, data.x).detach()
        for c in data.y.unique().tolist():
            zc = z[data.y == c]
            cov = torch.cov(zc.T) if len(zc) > 1 else torch.zeros(z.shape[1], z.shape[1]).double()
            local.append((c, len(zc), zc.mean(0), cov))
    means, covs = {}, {}
    for c in range(C):
        held = [(n, mu, cov) for j, n, mu, cov in local if j == c]
        total = sum(n for n, _, _ in held)
        if total < 2:
            continue
        mu = sum(n / total * m for n, m, _ in held)
        sigma = sum(
            (n - 1) / (total - 1) * s + n / (total - 1) * torch.outer(m, m) for n, m, s in held
        )
        means[c], covs[c] = mu, sigma - total / (total - 1) * torch.outer(mu, mu)
    return means, covs


def test_ccvr_calibrates_the_classifier_on_virtual_features_before_evaluating():
    from pflego.algorithms.ccvr import CALIBRATION_STREAM
    from pflego.rng import seed_for

    options = {
        "samples_per_class": SAMPLES,
        "calibration_batch_size": BATCH,
        "calibration_epochs": CALIBRATION_EPOCHS,
    }
    sim = Simulation(ragged_experiment("ccvr", options=options, **EPOCHS), None)
    w = fedavg_rounds(sim, 3)
    everyone = np.arange(sim.exp.data.num_clients)
    inputs = sim.round_inputs(3, everyone)
    means, covs = class_gaussians(w, [inputs.client(c) for c in range(len(everyone))])
    assert 1 < len(means) <= C

    ctx = sim.context(3)
    algorithm = sim.algorithm
    downlink = algorithm.downlink(sim.server, ctx)
    totals = None
    for c in range(len(everyone)):
        part_ = algorithm.statistics(downlink, inputs.client(c), ctx)
        totals = part_ if totals is None else {k: totals[k] + part_[k] for k in part_}
    z, y = algorithm.virtual_features(totals, ctx)
    # the draws: mu_c + L_c e with L_c = Sigma_c^(1/2) (eigenvalues below sqrt(eps) of the
    # largest dropped), e ~ N(0, I) from the run's stream
    noise = torch.randn(
        C,
        SAMPLES,
        z.shape[1],
        generator=torch.Generator().manual_seed(seed_for(sim.cfg.seed, CALIBRATION_STREAM, 3)),
        dtype=torch.float64,
    )
    expected = []
    for c in sorted(means):
        values, vectors = torch.linalg.eigh(covs[c])
        kept = torch.where(values > values[-1] * 2.0**-26, values, 0.0)
        root = vectors @ torch.diag(kept.sqrt()) @ vectors.T
        torch.testing.assert_close(root @ root, covs[c], rtol=0, atol=1e-6 * float(values[-1]))
        expected.append(means[c] + noise[c] @ root)
    torch.testing.assert_close(z, torch.cat(expected), rtol=1e-6, atol=1e-7)
    assert y.tolist() == [c for c in sorted(means) for _ in range(SAMPLES)]

    # the classifier retrained by SGD on shuffled minibatches of the virtual features
    order_gen = torch.Generator().manual_seed(seed_for(sim.cfg.seed, CALIBRATION_STREAM, 3, 1))
    head = part(w, HEAD)
    for _ in range(CALIBRATION_EPOCHS):
        for batch in torch.randperm(len(y), generator=order_gen).split(BATCH):
            g = gradient(
                lambda h, f, t: F.cross_entropy(f @ h["head.weight"].T + h["head.bias"], t),
                head,
                z[batch],
                y[batch],
            )
            head = {k: v - sim.cfg.client_lr * g[k] for k, v in head.items()}
    calibrated = {**part(w, BODY), **head}
    assert float((head["head.weight"] - w["head.weight"]).abs().max()) > 1e-3

    # evaluation predicts with the calibrated model; the server keeps FedAvg's
    record = sim.evaluate(3)
    accuracies = []
    for i in everyone:
        x, labels = sim.pools["test"].own(int(i))
        if len(labels):
            accuracies.append(float((logits(calibrated, x).argmax(-1) == labels).double().mean()))
    assert record["test_acc"] == pytest.approx(sum(accuracies) / len(accuracies), abs=1e-12)
    assert_close(sim.server["params"], w)


def test_flower_refuses_an_algorithm_that_calibrates_in_one_line():
    from pflego.config import load_config
    from pflego.errors import ConfigError
    from pflego.flower.unsupported import refuse_unsupported

    with pytest.raises(ConfigError, match="ccvr calibrates"):
        refuse_unsupported(load_config({"algorithm": "ccvr", "dataset": "tiny"}))


# --- FedPCL -----------------------------------------------------------------------------------

TAU = 0.5


def unit_features(p: dict, x) -> torch.Tensor:
    z = features(p, x)
    return z / z.norm(dim=-1, keepdim=True)


def pcl_loss(glob: dict, table: dict, population: int):
    """L_g + L_p with the prototype sets written out as dicts class -> prototype: client k's set
    is its own prototypes, the global ones for its missing classes (and for a client not yet
    heard from); a class absent from a set is out of its softmax."""
    sets = [{**glob, **table.get(k, {})} for k in range(population)]

    def term(z, label, protos: dict):
        if label not in protos:
            return z.sum() * 0
        classes = sorted(protos)
        sims = torch.stack([z @ protos[c] for c in classes]) / TAU
        return -torch.log_softmax(sims, 0)[classes.index(label)]

    def loss(p, x, y):
        z = unit_features(p, x)
        values = [
            term(z[s], int(label), glob) + sum(term(z[s], int(label), q) for q in sets) / len(sets)
            for s, label in enumerate(y)
        ]
        return sum(values) / len(values)

    return loss


def unit_prototypes(p: dict, x, y) -> dict[int, torch.Tensor]:
    z = unit_features(p, x).detach()
    return {int(j): z[y == j].mean(0) for j in y.unique()}


def pcl_train(start: dict, glob: dict, table: dict, population: int, data) -> dict:
    if not glob:  # no prototype yet: the loss is 0, nothing moves
        return {k: v.clone() for k, v in start.items()}
    return descend(start, pcl_loss(glob, table, population), steps_of(data))


def pcl_logits(p: dict, own: dict, x) -> torch.Tensor:
    z = unit_features(p, x)
    return torch.stack(
        [z @ own[c] if c in own else torch.full((len(x),), -2.0).double() for c in range(C)], -1
    )


def test_fedpcl_contrasts_features_with_global_and_every_clients_local_prototypes():
    settings = {"options": {"tau": TAU}, **EPOCHS}
    sim = Simulation(ragged_experiment("fedpcl", **settings), None)
    population = sim.exp.data.num_clients
    f0 = {k: v.clone() for k, v in sim.server["params"].items()}
    bodies: dict[int, dict] = {}
    table: dict[int, dict] = {}
    glob: dict[int, torch.Tensor] = {}
    revisits, partial = 0, False
    for t in range(4):
        cohort, start, clients = round_inputs(sim, t)
        assert_close(start, f0)
        uploads = {}
        for i, data in zip(cohort, clients, strict=True):
            revisits += i in bodies
            bodies[i] = pcl_train(bodies.get(i, f0), glob, table, population, data)
            uploads[i] = unit_prototypes(bodies[i], data.x, data.y)
        new = {
            j: sum(u[j] for u in uploads.values() if j in u) / sum(j in u for u in uploads.values())
            for j in range(C)
            if any(j in u for u in uploads.values())
        }
        partial |= bool(glob) and len(new) < C
        glob, table = {**glob, **new}, {**table, **uploads}
        sim.run_round(t)
        protos = sim.server["protos"]
        assert protos["present"].tolist() == [float(j in glob) for j in range(C)]
        for j, m in glob.items():
            torch.testing.assert_close(protos["mean"][j], m, rtol=1e-9, atol=1e-11)
        for k, own in table.items():
            assert protos["held"][k].tolist() == [float(j in own) for j in range(C)]
            for j, m in own.items():
                torch.testing.assert_close(protos["table"][k, j], m, rtol=1e-9, atol=1e-11)
        for i in cohort:
            assert_close(part(sim.store.get(i), BODY), bodies[i])
    assert revisits > 0 and partial and len(glob) == C

    # predict: the nearest of the client's own prototypes in inner product
    i = cohort[0]
    downlink = sim.algorithm.downlink(sim.server, sim.context(4))
    x = torch.randn(6, 1, 3, 3, dtype=torch.float64)
    torch.testing.assert_close(
        sim.algorithm.predict(downlink, sim.store.get(i), x), pcl_logits(bodies[i], table[i], x)
    )

    # join: f^0 trained on the same loss, then its own prototypes
    state, downlink, data, ctx = new_client(sim, 4)
    trained = pcl_train(f0, glob, table, population, data)
    own = unit_prototypes(trained, data.x, data.y)
    joined = sim.algorithm.join(downlink, state, data, ctx)
    assert_close(part(joined, BODY), trained)
    torch.testing.assert_close(
        sim.algorithm.predict(downlink, joined, data.x), pcl_logits(trained, own, data.x)
    )


# --- FedAH ------------------------------------------------------------------------------------

ETA_AH = 0.7


def schedule_steps(data, name: str) -> list:
    """The (x, y) of every real step of one of the client's named schedules."""
    batches, batch_mask = data.schedules[name]
    return [
        (data.x[row[m > 0]], data.y[row[m > 0]])
        for row, m in zip(batches, batch_mask, strict=True)
        if m.sum() > 0
    ]


def head_ce(body: dict):
    return lambda h, x, y: F.cross_entropy(logits({**body, **h}, x), y)


def fedah_client(glob: dict, own: dict | None, weights: dict | None, data):
    """Aggregated head (W learned by projected steps), head phase, body phase."""
    body, g_head = part(glob, BODY), part(glob, HEAD)
    local = g_head if own is None else own
    w = weights or {k: torch.ones_like(v) for k, v in g_head.items()}
    diff = {k: g_head[k] - local[k] for k in HEAD}
    for x, y in schedule_steps(data, "head"):
        hat = {k: local[k] + diff[k] * w[k] for k in HEAD}
        g = gradient(head_ce(body), hat, x, y)
        w = {k: (w[k] - ETA_AH * g[k] * diff[k]).clamp(0, 1) for k in HEAD}
    head = {k: local[k] + diff[k] * w[k] for k in HEAD}
    head = descend(head, head_ce(body), schedule_steps(data, "head"))
    trained = descend(
        body, lambda b, x, y: F.cross_entropy(logits({**b, **head}, x), y), steps_of(data)
    )
    return trained, head, w


def test_fedah_aggregates_own_and_global_heads_element_wise_then_trains_head_and_body():
    settings = {"options": {"eta": ETA_AH, "head_epochs": 1.0}, **EPOCHS}
    sim = Simulation(ragged_experiment("fedah", **settings), None)
    glob = {k: v.clone() for k, v in sim.server["params"].items()}
    heads: dict[int, dict] = {}
    weights: dict[int, dict] = {}
    moved = 0.0
    for t in range(4):
        cohort, start, clients = round_inputs(sim, t)
        assert_close(start, glob)
        models, sizes = [], []
        for i, data in zip(cohort, clients, strict=True):
            body, head, w = fedah_client(glob, heads.get(i), weights.get(i), data)
            if i in weights:
                moved = max(moved, float(min((w[k] - 1).abs().max() for k in HEAD)))
            heads[i], weights[i] = head, w
            models.append({**body, **head})
            sizes.append(float(len(data.y)))
        glob = {
            k: sum(n * m[k] for n, m in zip(sizes, models, strict=True)) / sum(sizes) for k in glob
        }
        sim.run_round(t)
        assert_close(sim.server["params"], glob)
        for i in cohort:
            state = sim.store.get(i)
            assert_close({k: state[f"local.{k}"] for k in HEAD}, heads[i])
            assert_close({k: state[f"weights.{k}"] for k in HEAD}, weights[i])
    assert moved > 1e-3  # the weights were learned, not left at one

    # predict: the global extractor with the client's own head
    i = cohort[0]
    downlink = sim.algorithm.downlink(sim.server, sim.context(4))
    x = torch.randn(6, 1, 3, 3, dtype=torch.float64)
    torch.testing.assert_close(
        sim.algorithm.predict(downlink, sim.store.get(i), x),
        logits({**part(glob, BODY), **heads[i]}, x),
    )

    # join: the global head trained on the frozen global extractor's features
    state, downlink, data, ctx = new_client(sim, 4)
    torch.testing.assert_close(sim.algorithm.predict(downlink, state, x), logits(glob, x))
    expected = descend(part(glob, HEAD), head_ce(part(glob, BODY)), steps_of(data))
    joined = sim.algorithm.join(downlink, state, data, ctx)
    assert_close({k: joined[f"local.{k}"] for k in HEAD}, expected)
    torch.testing.assert_close(
        sim.algorithm.predict(downlink, joined, x), logits({**part(glob, BODY), **expected}, x)
    )


# --- FedGC ------------------------------------------------------------------------------------

LAM_GC = 0.5


def restricted_ce(classes: list[int], fixed: dict | None = None):
    """Softmax cross-entropy over the client's own classes only."""

    def loss(p, x, y):
        out = logits({**p, **(fixed or {})}, x)[:, classes]
        return F.cross_entropy(out, torch.tensor([classes.index(int(c)) for c in y]))

    return loss


def gc_regularizer(weights: dict[int, torch.Tensor], held: dict[int, list[int]]):
    """PFLlib's reg_train with plain loops: a term per (client, held class)."""
    e = {
        c: (
            sum(weights[k][c] for k in held if c in held[k]) / sum(c in held[k] for k in held)
        ).detach()
        for c in range(C)
        if any(c in held[k] for k in held)
    }
    total = 0
    for k in held:
        for c in held[k]:
            own = torch.exp(e[c] @ e[c])
            rivals = sum(
                torch.exp(weights[j][d] @ e[c]) for j in held if c not in held[j] for d in held[j]
            )
            total = total - torch.log(own / (own + rivals))
    return total


def test_fedgc_corrects_every_clients_class_embeddings_with_the_cross_client_regularizer():
    settings = {"options": {"lam": LAM_GC}, **EPOCHS}
    sim = Simulation(ragged_experiment("fedgc", **settings), None)
    theta = {k: v.clone() for k, v in sim.server["params"].items()}
    phi0 = {k: v.clone() for k, v in sim.server["head"].items()}
    heads: dict[int, dict] = {}
    held: dict[int, list[int]] = {}
    revisits = 0
    for t in range(4):
        cohort, start, clients = round_inputs(sim, t)
        assert_close(start, theta)
        bodies, sizes = [], []
        for i, data in zip(cohort, clients, strict=True):
            revisits += i in heads
            classes = sorted(set(data.y.tolist()))
            w = descend({**theta, **heads.get(i, phi0)}, restricted_ce(classes), steps_of(data))
            bodies.append(part(w, BODY))
            sizes.append(float(len(data.y)))
            heads[i], held[i] = part(w, HEAD), classes
        theta = {
            k: sum(n * b[k] for n, b in zip(sizes, bodies, strict=True)) / sum(sizes) for k in theta
        }
        weights = {k: h["head.weight"].detach().requires_grad_(True) for k, h in heads.items()}
        grads = torch.autograd.grad(gc_regularizer(weights, held), list(weights.values()))
        for k, g in zip(weights, grads, strict=True):
            heads[k] = {**heads[k], "head.weight": heads[k]["head.weight"] - LR * LAM_GC * g}
        sim.run_round(t)
        assert_close(sim.server["params"], theta)
        table = sim.server["gc"]
        for k, head in heads.items():
            assert_close({n: table[n][k] for n in HEAD}, head)
            assert table["held"][k].tolist() == [float(c in held[k]) for c in range(C)]
        assert float(max(g.abs().max() for g in grads)) > 1e-6  # the step moved the heads
    assert revisits > 0

    # predict: theta with the client's own head, over its own classes
    i = cohort[0]
    ids = torch.as_tensor([i])
    downlink = {k: v[0] for k, v in sim.algorithm.downlink(sim.server, sim.context(4), ids).items()}
    x = torch.randn(6, 1, 3, 3, dtype=torch.float64)
    own = torch.tensor([c in held[i] for c in range(C)])
    expected = torch.where(own, logits({**theta, **heads[i]}, x), torch.finfo(x.dtype).min)
    torch.testing.assert_close(sim.algorithm.predict(downlink, {}, x), expected)

    # join: phi^0 trained on the frozen global backbone's features over the client's classes
    state, downlink, data, ctx = new_client(sim, 4)
    classes = sorted(set(data.y.tolist()))
    head = descend(phi0, restricted_ce(classes, theta), steps_of(data))
    joined = sim.algorithm.join(downlink, state, data, ctx)
    assert_close(part(joined, HEAD), head)
    own = torch.tensor([c in classes for c in range(C)])
    expected = torch.where(own, logits({**theta, **head}, x), torch.finfo(x.dtype).min)
    torch.testing.assert_close(sim.algorithm.predict(downlink, joined, x), expected)


# --- pFedFDA ----------------------------------------------------------------------------------

EPS_FDA, FOLDS, BETAS = 0.05, 2, 5


def lda(mean, cov, prior) -> dict:
    m = cov.shape[0]
    shrunk = (1 - EPS_FDA) * cov + EPS_FDA * torch.trace(cov) / m * torch.eye(m).double()
    weight = (torch.linalg.inv(shrunk) @ mean.T).T
    bias = torch.stack([-0.5 * mean[c] @ weight[c] for c in range(len(mean))]) + prior.log()
    return {"head.weight": weight, "head.bias": bias}


def class_prior(y) -> torch.Tensor:
    counts = torch.tensor([float((y == c).sum()) for c in range(C)]).double()
    smoothed = counts / len(y) + EPS_FDA
    return smoothed / smoothed.sum()


def mle(z, y, rows: list[int], glob_mean):
    """Class means (classes with more than k of the rows; else the global mean), and the
    scatter about them over len(rows) - 1, plus the identity."""
    means = glob_mean.clone()
    for c in range(C):
        mine = [s for s in rows if int(y[s]) == c]
        if len(mine) > FOLDS:
            means[c] = z[mine].mean(0)
    cov = torch.eye(z.shape[1]).double()
    if rows:
        gaps = torch.stack([z[s] - means[int(y[s])] for s in rows])
        cov = gaps.T @ gaps / max(len(rows) - 1, 1) + cov
    return means, cov


def fda_statistics(body: dict, data, glob: tuple) -> tuple:
    """beta by k-fold cross-validation on the grid, and the interpolated statistics."""
    z = features(body, data.x).detach()
    y, prior = data.y, class_prior(data.y)
    seen: dict[int, int] = {}
    rank = []
    for label in y.tolist():
        rank.append(seen.get(label, 0))
        seen[label] = rank[-1] + 1
    eligible = [s for s in range(len(y)) if seen[int(y[s])] >= FOLDS]
    best, beta = None, 0.0
    for b in torch.linspace(0, 1, BETAS).double().tolist():
        total = 0.0
        for f in range(FOLDS):
            test = [s for s in eligible if rank[s] % FOLDS == f]
            mean, cov = mle(z, y, [s for s in eligible if s not in test], glob[0])
            head = lda(b * mean + (1 - b) * glob[0], b * cov + (1 - b) * glob[1], prior)
            if test:
                out = z[test] @ head["head.weight"].T + head["head.bias"]
                total += float(F.cross_entropy(out, y[test]))
        if best is None or total < best - 1e-12:
            best, beta = total, b
    mean, cov = mle(z, y, list(range(len(y))), glob[0])
    return beta, beta * mean + (1 - beta) * glob[0], beta * cov + (1 - beta) * glob[1]


def test_pfedfda_trains_under_the_global_gaussian_classifier_and_interpolates_statistics():
    options = {"eps": EPS_FDA, "folds": FOLDS, "betas": BETAS}
    sim = Simulation(ragged_experiment("pfedfda", options=options, **EPOCHS), None)
    theta = {k: v.clone() for k, v in sim.server["params"].items()}
    glob = (sim.server["gauss"]["gauss.mean"].clone(), sim.server["gauss"]["gauss.cov"].clone())
    chosen = set()
    for t in range(3):
        cohort, start, clients = round_inputs(sim, t)
        assert_close(start, theta)
        bodies, stats, sizes = [], [], []
        for data in clients:
            head = lda(*glob, class_prior(data.y))
            body = descend(theta, restricted_ce(list(range(C)), head), steps_of(data))
            beta, mean, cov = fda_statistics(body, data, glob)
            chosen.add(beta)
            bodies.append(body)
            stats.append((mean, cov))
            sizes.append(float(len(data.y)))
        share = [n / sum(sizes) for n in sizes]
        theta = {k: sum(w * b[k] for w, b in zip(share, bodies, strict=True)) for k in theta}
        glob = tuple(sum(w * s[j] for w, s in zip(share, stats, strict=True)) for j in (0, 1))
        sim.run_round(t)
        assert_close(sim.server["params"], theta)
        assert_close(sim.server["gauss"], {"gauss.mean": glob[0], "gauss.cov": glob[1]})
    assert len(chosen) > 1  # beta depends on the client

    # adapt / join: the classifier of the client's interpolated statistics under theta
    state, downlink, data, ctx = new_client(sim, 3)
    _, mean, cov = fda_statistics(theta, data, glob)
    head = lda(mean, cov, class_prior(data.y))
    for personalize in (sim.algorithm.adapt, sim.algorithm.join):
        adapted = personalize(downlink, state, data, ctx)
        assert_close(adapted, head)
        torch.testing.assert_close(
            sim.algorithm.predict(downlink, adapted, data.x), logits({**theta, **head}, data.x)
        )
