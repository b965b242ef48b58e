"""The distillation methods (FD, FML, FedKD, ...): each defining update, ``predict`` and ``join``
against a hand-written float64 reference.

The references use only torch autograd on the MLP written out by hand (``test_classic``'s
``features`` / ``logits``; no library training loop, loss, tree algebra or optimizer) and run
client by client on the ragged clients of ``test_fast_sim`` (sizes 3..14, one to three classes
each); with ``local_epochs`` and a batch size the clients take different numbers of local steps.
The library runs the real round loop and the two must agree to rounding.
"""

from __future__ import annotations

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

from pflego.sim import Simulation

C = 4  # classes of the ragged dataset


def descend(start: dict, loss, steps) -> dict:
    p = {k: v.clone() for k, v in start.items()}
    for x, y in steps:
        g = gradient(loss, p, x, y)
        p = {k: v - LR * g[k] for k, v in p.items()}
    return p


def probe() -> torch.Tensor:
    return torch.randn(7, 1, 3, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(3))


# --- FD (FedDistill) --------------------------------------------------------------------------

LAM = 0.7


def fd_loss(targets: dict[int, torch.Tensor]):
    """CE + LAM * sum over rows with a target of ||z_s - target||^2 / (B C): MSELoss over [B, C]."""

    def loss(p, x, y):
        z = logits(p, x)
        gaps = [((z[s] - targets[int(c)]) ** 2).sum() for s, c in enumerate(y) if int(c) in targets]
        return F.cross_entropy(z, y) + LAM * sum(gaps, z.sum() * 0) / z.numel()

    return loss


def class_logits(p: dict, x: torch.Tensor, y: torch.Tensor) -> dict[int, tuple]:
    z = logits(p, x).detach()
    return {int(j): (z[y == j].mean(0), int((y == j).sum())) for j in y.unique()}


@pytest.mark.parametrize("weights", ["clients", "samples"])
def test_feddistill_pulls_logits_to_the_global_class_logits_and_averages_them(weights):
    options = {"lam": LAM, "logit_weights": weights}
    sim = Simulation(ragged_experiment("feddistill", options=options, **EPOCHS), None)
    w0 = {k: v.clone() for k, v in sim.server["params"].items()}
    models: dict[int, dict] = {}
    table: dict[int, torch.Tensor] = {}
    revisits = 0
    for t in range(4):
        cohort, start, clients = round_inputs(sim, t)
        assert_close(start, w0)
        uploads = []
        for i, data in zip(cohort, clients, strict=True):
            revisits += i in models
            models[i] = descend(models.get(i, w0), fd_loss(table), steps_of(data))
            uploads.append(class_logits(models[i], data.x, data.y))
        for j in range(C):
            held = [u[j] for u in uploads if j in u]
            if held:
                w = [n if weights == "samples" else 1 for _, n in held]
                table[j] = sum(wi * m for wi, (m, _) in zip(w, held, strict=True)) / sum(w)
        sim.run_round(t)
        assert sim.server["logits"]["present"].tolist() == [float(j in table) for j in range(C)]
        for j, m in table.items():
            torch.testing.assert_close(sim.server["logits"]["mean"][j], m, rtol=1e-9, atol=1e-11)
        for i in cohort:
            assert_close(sim.store.get(i), models[i])
    assert revisits > 0 and len(table) == C

    # predict: the client's own model; join: w^0 trained against the global logits
    ctx = sim.context(4)
    downlink = sim.algorithm.downlink(sim.server, ctx)
    x = probe()
    torch.testing.assert_close(
        sim.algorithm.predict(downlink, sim.store.get(i), x), logits(models[i], x)
    )
    cohort = sim.cohort(4)
    data = sim.round_inputs(4, cohort).client(0)
    first = sim.init_state(int(cohort[0]), downlink, ctx)
    joined = sim.algorithm.join(downlink, first, data, ctx)
    expected = descend(w0, fd_loss(table), steps_of(data))
    assert_close(joined, expected)
    torch.testing.assert_close(sim.algorithm.predict(downlink, joined, x), logits(expected, x))


# --- FML --------------------------------------------------------------------------------------

ALPHA, BETA = 0.3, 0.6


def kl(p_logits: torch.Tensor, q_logits: torch.Tensor) -> torch.Tensor:
    """Mean over rows of sum_c p_c log(p_c / q_c), written from the softmaxes."""
    p, q = torch.softmax(p_logits, -1), torch.softmax(q_logits, -1)
    return (p * (p.log() - q.log())).sum(-1).mean()


def dml(p, x, y, target, weight):
    """weight CE + (1 - weight) KL(softmax(target) || softmax(f(x; p)))."""
    return weight * F.cross_entropy(logits(p, x), y) + (1 - weight) * kl(target, logits(p, x))


def mutual_steps(private: dict, meme: dict, steps, alpha, beta) -> tuple[dict, dict]:
    """DML: both models step at once, each on its CE and its KL to the other's fixed output."""
    private, meme = dict(private), dict(meme)
    for x, y in steps:
        z_meme, z_private = logits(meme, x).detach(), logits(private, x).detach()
        g_p = gradient(dml, private, x, y, z_meme, alpha)
        g_m = gradient(dml, meme, x, y, z_private, beta)
        private = {k: v - LR * g_p[k] for k, v in private.items()}
        meme = {k: v - LR * g_m[k] for k, v in meme.items()}
    return private, meme


def test_fml_trains_private_and_meme_models_mutually_and_averages_the_memes():
    options = {"alpha": ALPHA, "beta": BETA}
    sim = Simulation(ragged_experiment("fml", options=options, **EPOCHS), None)
    w = {k: v.clone() for k, v in sim.server["params"].items()}
    w0 = dict(w)
    private: dict[int, dict] = {}
    revisits = 0
    for t in range(4):
        cohort, start, clients = round_inputs(sim, t)
        assert_close(start, w)
        memes, sizes = [], []
        for i, data in zip(cohort, clients, strict=True):
            revisits += i in private
            private[i], meme = mutual_steps(private.get(i, w0), w, steps_of(data), ALPHA, BETA)
            memes.append(meme)
            sizes.append(len(data.y))
        w = {k: sum(n * m[k] for n, m in zip(sizes, memes, strict=True)) / sum(sizes) for k in w}
        sim.run_round(t)
        assert_close(sim.server["params"], w)
        for i in cohort:
            assert_close(sim.store.get(i), {f"private.{k}": v for k, v in private[i].items()})
    assert revisits > 0

    # predict: the private model (the meme model as ``meme``); join: a first visit's DML
    ctx = sim.context(4)
    downlink = sim.algorithm.downlink(sim.server, ctx)
    x = probe()
    state = sim.store.get(i)
    torch.testing.assert_close(sim.algorithm.predict(downlink, state, x), logits(private[i], x))
    torch.testing.assert_close(sim.algorithm.predict_meme(downlink, None, x), logits(w, x))
    cohort = sim.cohort(4)
    data = sim.round_inputs(4, cohort).client(0)
    joined = sim.algorithm.join(downlink, sim.init_state(int(cohort[0]), downlink, ctx), data, ctx)
    expected, _ = mutual_steps(w0, w, steps_of(data), ALPHA, BETA)
    assert_close(joined, {f"private.{k}": v for k, v in expected.items()})
    torch.testing.assert_close(sim.algorithm.predict(downlink, joined, x), logits(expected, x))


# --- FedKD ------------------------------------------------------------------------------------


def mentor_loss(p, x, y, z_s, target, den):
    """L_t: CE + (KL(y_s, y_t) + MSE(H_t, W_h H_s)) / den, the mentee's side fixed."""
    z = logits(p, x)
    return F.cross_entropy(z, y) + (kl(z_s, z) + ((features(p, x) - target) ** 2).mean()) / den


def mentee_loss(p, x, y, z_t, h_t, den):
    """L_s: CE + (KL(y_t, y_s) + MSE(H_t, W_h H_s)) / den, the mentor's side fixed."""
    m = {k: v for k, v in p.items() if k != "proj"}
    z, projected = logits(m, x), features(m, x) @ p["proj"].T
    return F.cross_entropy(z, y) + (kl(z_t, z) + ((h_t - projected) ** 2).mean()) / den


def fedkd_steps(mentor: dict, proj: torch.Tensor, mentee: dict, steps):
    """Adaptive mutual distillation, written from the paper's Eqs. 1-4: both models and W_h step
    at once; each distillation loss over the (fixed) sum of the task losses."""
    mentor, mentee = dict(mentor), dict(mentee)
    for x, y in steps:
        h_t, h_s = features(mentor, x).detach(), features(mentee, x).detach()
        z_t, z_s = logits(mentor, x).detach(), logits(mentee, x).detach()
        den = F.cross_entropy(z_t, y) + F.cross_entropy(z_s, y)
        g_t = gradient(mentor_loss, mentor, x, y, z_s, h_s @ proj.T, den)
        g_s = gradient(mentee_loss, {**mentee, "proj": proj}, x, y, z_t, h_t, den)
        mentor = {k: v - LR * g_t[k] for k, v in mentor.items()}
        mentee = {k: v - LR * g_s[k] for k, v in mentee.items()}
        proj = proj - LR * g_s["proj"]
    return mentor, proj, mentee


def truncated(update: torch.Tensor, energy: float) -> torch.Tensor:
    """The fewest leading singular triplets whose energy exceeds ``energy`` of the total."""
    u, s, vh = torch.linalg.svd(update, full_matrices=False)
    total, rank = float((s**2).sum()), 0
    while float((s[:rank] ** 2).sum()) <= energy * total:
        rank += 1
    return u[:, :rank] @ torch.diag(s[:rank]) @ vh[:rank]


@pytest.mark.parametrize("energy", [None, 0.6])
def test_fedkd_distils_mentor_and_mentee_adaptively_and_averages_the_mentees(energy):
    options = {} if energy is None else {"energy": energy}
    sim = Simulation(ragged_experiment("fedkd", options=options, **EPOCHS), None)
    w = {k: v.clone() for k, v in sim.server["params"].items()}
    w0 = dict(w)
    state: dict[int, tuple] = {}
    revisits, ranks = 0, set()
    for t in range(4):
        cohort, start, clients = round_inputs(sim, t)
        assert_close(start, w)
        updates, sizes = [], []
        for i, data in zip(cohort, clients, strict=True):
            revisits += i in state
            proj = sim.init_state(i, w, sim.context(t))["proj.weight"]
            mentor, proj = state.get(i, (w0, proj))
            mentor, proj, mentee = fedkd_steps(mentor, proj, w, steps_of(data))
            state[i] = (mentor, proj)
            update = {k: w[k] - mentee[k] for k in w}
            if energy is not None:
                for k in ("body.1.weight", "head.weight"):
                    update[k] = truncated(update[k], energy)
                    ranks.add(int(torch.linalg.matrix_rank(update[k])))
            updates.append(update)
            sizes.append(len(data.y))
        w = {
            k: w[k] - sum(n * u[k] for n, u in zip(sizes, updates, strict=True)) / sum(sizes)
            for k in w
        }
        sim.run_round(t)
        assert_close(sim.server["params"], w)
        for i in cohort:
            mentor, proj = state[i]
            expected = {**{f"mentor.{k}": v for k, v in mentor.items()}, "proj.weight": proj}
            assert_close(sim.store.get(i), expected)
    assert revisits > 0
    assert energy is None or min(ranks) < 4  # the compression dropped singular values

    # predict: the mentor (the mentee as ``mentee``); join: a first visit's distillation
    ctx = sim.context(4)
    downlink = sim.algorithm.downlink(sim.server, ctx)
    x = probe()
    own = sim.store.get(i)
    torch.testing.assert_close(sim.algorithm.predict(downlink, own, x), logits(state[i][0], x))
    torch.testing.assert_close(sim.algorithm.predict_mentee(downlink, None, x), logits(w, x))
    cohort = sim.cohort(4)
    data = sim.round_inputs(4, cohort).client(0)
    first = sim.init_state(int(cohort[0]), downlink, ctx)
    joined = sim.algorithm.join(downlink, first, data, ctx)
    mentor, proj, _ = fedkd_steps(w0, first["proj.weight"], w, steps_of(data))
    assert_close(joined, {**{f"mentor.{k}": v for k, v in mentor.items()}, "proj.weight": proj})
    torch.testing.assert_close(sim.algorithm.predict(downlink, joined, x), logits(mentor, x))


# --- PFL-DA -----------------------------------------------------------------------------------

BETA_DA = 0.7


def pflda_visit(body: dict, decoder: dict, g: dict, steps):
    """(a) SGD on the feature map and a copy of g; (b) the decoder from beta g + (1 - beta) d,
    SGD on its loss over the adapted feature map."""
    adapted = descend({**body, **g}, lambda p, x, y: F.cross_entropy(logits(p, x), y), steps)
    body = {k: v for k, v in adapted.items() if k.startswith("body.")}
    start = {k: BETA_DA * g[k] + (1 - BETA_DA) * decoder[k] for k in g}
    trained = descend(start, lambda p, x, y: F.cross_entropy(logits({**body, **p}, x), y), steps)
    return body, trained, {k: adapted[k] for k in g}


def test_pflda_adapts_private_feature_maps_to_the_averaged_global_head():
    sim = Simulation(ragged_experiment("pflda", options={"beta": BETA_DA}, **EPOCHS), None)
    g = {k: v.clone() for k, v in sim.server["params"].items()}
    assert set(g) == {"head.weight", "head.bias"}
    states: dict[int, tuple] = {}
    revisits = 0
    for t in range(4):
        cohort, start, clients = round_inputs(sim, t)
        assert_close(start, g)
        copies, sizes = [], []
        for i, data in zip(cohort, clients, strict=True):
            revisits += i in states
            if i not in states:
                first = sim.init_state(i, g, sim.context(t))
                states[i] = (
                    {k: v for k, v in first.items() if k.startswith("body.")},
                    {k[9:]: v for k, v in first.items() if k.startswith("personal.")},
                )
            body, decoder, copy = pflda_visit(*states[i], g, steps_of(data))
            states[i] = (body, decoder)
            copies.append(copy)
            sizes.append(len(data.y))
        g = {k: sum(n * c[k] for n, c in zip(sizes, copies, strict=True)) / sum(sizes) for k in g}
        sim.run_round(t)
        assert_close(sim.server["params"], g)
        for i in cohort:
            body, decoder = states[i]
            expected = {**body, **{f"personal.{k}": v for k, v in decoder.items()}}
            assert_close(sim.store.get(i), expected)
    assert revisits > 0

    # predict: d_i(Phi_i(x)); join: a first visit's (a) and (b) from Phi = w^0's body
    ctx = sim.context(4)
    downlink = sim.algorithm.downlink(sim.server, ctx)
    x = probe()
    body, decoder = states[i]
    torch.testing.assert_close(
        sim.algorithm.predict(downlink, sim.store.get(i), x), logits({**body, **decoder}, x)
    )
    cohort = sim.cohort(4)
    data = sim.round_inputs(4, cohort).client(0)
    first = sim.init_state(int(cohort[0]), downlink, ctx)
    w0 = sim.algorithm.init_params(sim.cfg.seed, torch.float64)
    assert_close(
        {k: v for k, v in first.items() if k.startswith("body.")},
        {k: w0[k] for k in ("body.1.weight", "body.1.bias")},
    )
    joined = sim.algorithm.join(downlink, first, data, ctx)
    decoder0 = {k[9:]: v for k, v in first.items() if k.startswith("personal.")}
    body, decoder, _ = pflda_visit(
        {k: w0[k] for k in ("body.1.weight", "body.1.bias")}, decoder0, g, steps_of(data)
    )
    assert_close(joined, {**body, **{f"personal.{k}": v for k, v in decoder.items()}})
    torch.testing.assert_close(
        sim.algorithm.predict(downlink, joined, x), logits({**body, **decoder}, x)
    )


# --- FedMD ------------------------------------------------------------------------------------

DIGEST = 3


def digest_loss(p, x, y, consensus, kind):
    """The mean over the public rows and classes of |f(x_j) - consensus_j| (mae) or its square."""
    gap = logits(p, x) - consensus
    return (gap.abs() if kind == "mae" else gap * gap).mean()


def fedmd_visit(model: dict, public: torch.Tensor, consensus, steps, kind="mae") -> dict:
    """Digest (DIGEST full-batch steps toward the consensus, none before one exists), revisit."""
    if consensus is not None:
        for _ in range(DIGEST):
            g = gradient(digest_loss, model, public, None, consensus, kind)
            model = {k: v - LR * g[k] for k, v in model.items()}
    return descend(model, lambda p, x, y: F.cross_entropy(logits(p, x), y), steps)


@pytest.mark.parametrize("kind", ["mae", "mse"])
def test_fedmd_digests_the_consensus_on_public_data_then_revisits_private_data(kind):
    options = {"public_size": 12, "digest_steps": DIGEST, "digest_loss": kind}
    sim = Simulation(ragged_experiment("fedmd", options=options, **EPOCHS), None)
    public = sim.server["public"]["x"]
    assert public.shape == (12, 1, 3, 3) and public.dtype == torch.float64
    w0 = {k: v.clone() for k, v in sim.server["params"].items()}
    models: dict[int, dict] = {}
    consensus = None
    revisits = 0
    for t in range(4):
        cohort, start, clients = round_inputs(sim, t)
        assert_close(start, w0)
        scores = []
        for i, data in zip(cohort, clients, strict=True):
            revisits += i in models
            models[i] = fedmd_visit(models.get(i, w0), public, consensus, steps_of(data), kind)
            scores.append(logits(models[i], public).detach())
        consensus = sum(scores) / len(scores)  # the plain mean over the cohort
        sim.run_round(t)
        torch.testing.assert_close(
            sim.server["consensus"]["scores"], consensus, rtol=1e-9, atol=1e-11
        )
        for i in cohort:
            assert_close(sim.store.get(i), models[i])
    assert revisits > 0

    # predict: the client's own model; join: w^0 digested and trained on the client's data
    ctx = sim.context(4)
    downlink = sim.algorithm.downlink(sim.server, ctx)
    x = probe()
    torch.testing.assert_close(
        sim.algorithm.predict(downlink, sim.store.get(i), x), logits(models[i], x)
    )
    cohort = sim.cohort(4)
    data = sim.round_inputs(4, cohort).client(0)
    joined = sim.algorithm.join(downlink, sim.init_state(int(cohort[0]), downlink, ctx), data, ctx)
    expected = fedmd_visit(w0, public, consensus, steps_of(data), kind)
    assert_close(joined, expected)
    torch.testing.assert_close(sim.algorithm.predict(downlink, joined, x), logits(expected, x))


def test_the_public_set_is_a_seeded_draw_of_distinct_training_inputs_or_a_one_line_refusal():
    from pflego.config import load_config
    from pflego.errors import ConfigError
    from pflego.sim import build_experiment

    settings = {"dataset": "tiny", "clients": 4, "algorithm": "fedmd", "dtype": "float64"}
    exp = build_experiment(load_config({**settings, "options": {"public_size": 30}}))
    again = build_experiment(load_config({**settings, "options": {"public_size": 30}}))
    other = build_experiment(load_config({**settings, "seed": 1, "options": {"public_size": 30}}))
    assert torch.equal(exp.public, again.public) and not torch.equal(exp.public, other.public)
    assert len(exp.public.flatten(1).unique(dim=0)) == 30
    pool = torch.as_tensor(__import__("conftest").load_tiny(None).x_train)
    assert all((pool == row).flatten(1).all(1).any() for row in exp.public)
    assert build_experiment(load_config({**settings, "algorithm": "fedavg"})).public is None
    with pytest.raises(ConfigError, match="^public_size=241 exceeds the 240 training samples"):
        build_experiment(load_config({**settings, "options": {"public_size": 241}}))


def test_flower_refuses_an_algorithm_that_needs_public_data():
    pytest.importorskip("flwr")
    from conftest import tiny_experiment

    from pflego.errors import ConfigError
    from pflego.flower.unsupported import refuse_unsupported

    with pytest.raises(ConfigError, match="^fedmd needs public data .* `pflego run`$"):
        refuse_unsupported(tiny_experiment(algorithm="fedmd").config)
    refuse_unsupported(tiny_experiment(algorithm="feddistill").config)
