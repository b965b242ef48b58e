"""Bi-level local updates (APFL, Per-FedAvg) run fused equal their autograd paths, and fall back
to them where they do not fuse."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from test_fused import client, setting

from pflego.algorithms.apfl import APFL
from pflego.algorithms.perfedavg import PerFedAvg
from pflego.algorithms.pgfed import PGFed
from pflego.local import fused_steps
from pflego.optim import SGD, Momentum
from pflego.sim.backends import fuses
from pflego.types import RoundContext

CTX = RoundContext(0, 1, 1.0, 13, 0.2, 1.0)


def fused_and_autograd(algorithm, params, state, data):
    """``client_update`` with autograd and inside ``fused_steps``, and the latter's counts."""
    reference = algorithm.client_update(params, state, data, CTX)
    with fused_steps() as counts:
        fused = algorithm.client_update(params, state, data, CTX)
    return reference, fused, counts


def assert_same_update(reference, fused) -> None:
    (ref_out, ref_state), (out, state) = reference, fused
    for got, expected in ((out.upload, ref_out.upload), (state, ref_state)):
        assert got.keys() == expected.keys()
        for k in expected:
            torch.testing.assert_close(got[k], expected[k], atol=1e-10, rtol=1e-9, msg=k)
    torch.testing.assert_close(out.metrics["loss"], ref_out.metrics["loss"], atol=1e-10, rtol=1e-9)


@pytest.mark.parametrize("name", ["mlp", "conv"])
@pytest.mark.parametrize(
    "options",
    [
        {"alpha": 0.3},
        {"alpha": 0.0},
        {"alpha": 0.7, "adaptive_alpha": True, "alpha_update": "round"},
        {"alpha": 0.4, "weight_decay": 0.05},
    ],
    ids=["fixed", "alpha-0", "round", "weight-decay"],
)
def test_apfl_steps_fused_equal_autograd(name, options):
    """w's step at w and v's at the mixture, on one minibatch per step, in one fused call; a
    revisiting client's v_i differs from w
    (unless alpha is 0)."""
    options = dict(options)
    optimizer = SGD(weight_decay=options.pop("weight_decay", 0.0))
    model, params, x, y = setting(name)
    data = client(x, y, 4, 2.0)
    algorithm = APFL(model=model, client_optimizer=optimizer, **options)
    state = algorithm.init_client(params, None, CTX)
    for _visit in range(2):
        reference, fused, counts = fused_and_autograd(algorithm, params, state, data)
        assert (counts.fused, counts.autograd) == (1, 0)
        assert_same_update(reference, fused)
        state = reference[1]
    moved = not torch.equal(state["v.head.weight"], params["head.weight"])
    assert moved == (algorithm.alpha > 0)  # with alpha 0, v's gradient alpha g is 0
    assert fuses(algorithm, params, state, data, CTX)


def test_apfl_what_does_not_fuse_runs_autograd():
    """alpha_i stepping at every step, or momentum: autograd, and ``fuses`` says so."""
    model, params, x, y = setting("mlp")
    data = client(x, y, 4, 1.0)
    for algorithm in (
        APFL(model=model, adaptive_alpha=True, client_optimizer=SGD()),
        APFL(model=model, client_optimizer=Momentum()),
    ):
        state = algorithm.init_client(params, None, CTX)
        reference, fused, counts = fused_and_autograd(algorithm, params, state, data)
        assert counts.fused == 0 and counts.autograd > 0
        assert_same_update(reference, fused)
        assert not fuses(algorithm, params, state, data, CTX)


def meta_client(name: str):
    """A model, its parameters and a client whose ``meta`` schedule has an odd number of rows (a
    padding row in front) and an empty row (its group is skipped)."""
    model, params, x, y = setting(name)
    data = client(x, y, 4, 2.0)  # 8 rows, the second empty
    meta = (data.batches[1:], data.batch_mask[1:])  # 7 rows: the groups are aligned at the end
    return model, params, data._replace(schedules={"meta": meta})


@pytest.mark.parametrize("name", ["mlp", "conv"])
@pytest.mark.parametrize("variant", ["fo", "code"])
def test_perfedavg_meta_steps_fused_equal_autograd(name, variant):
    """w' = w - alpha grad f(w; D), then w <- w - beta grad f(w'; D') (``code``: from w'), all
    meta-steps in one fused call."""
    model, params, data = meta_client(name)
    algorithm = PerFedAvg(model=model, alpha=0.2, variant=variant, client_optimizer=SGD())
    state = algorithm.init_client(params, None, CTX)
    reference, fused, counts = fused_and_autograd(algorithm, params, state, data)
    assert (counts.fused, counts.autograd) == (1, 0)
    assert_same_update(reference, fused)
    assert not torch.equal(fused[0].upload["head.weight"], torch.zeros_like(params["head.weight"]))
    assert fuses(algorithm, params, state, data, CTX)


@pytest.mark.parametrize("name", ["mlp", "conv"])
@pytest.mark.parametrize("rows", [[0], [0, 2], [1, 0]], ids=["one", "two", "empty-first"])
def test_perfedavg_adapt_fused_equals_autograd(name, rows):
    """The evaluation's step(s) from w (alpha, then beta with ``personalize="code"``) in one fused
    call; an empty minibatch's step changes nothing."""
    model, params, data = meta_client(name)  # row 1 of its schedule is empty
    data = data._replace(batches=data.batches[rows], batch_mask=data.batch_mask[rows])
    algorithm = PerFedAvg(model=model, alpha=0.2, personalize="code", client_optimizer=SGD())
    reference = algorithm.adapt(params, {}, data, CTX)
    with fused_steps() as counts:
        fused = algorithm.adapt(params, {}, data, CTX)
    assert (counts.fused, counts.autograd) == (1, 0)
    assert fused.keys() == reference.keys()
    for k in reference:
        torch.testing.assert_close(fused[k], reference[k], atol=1e-10, rtol=1e-9, msg=k)
    assert not torch.equal(fused["head.weight"], params["head.weight"])  # one real step at least


def test_perfedavg_what_does_not_fuse_runs_autograd():
    """HF's Hessian-vector product and an l2 term in f run autograd, and ``fuses`` says so."""
    model, params, data = meta_client("mlp")
    hf = PerFedAvg(model=model, alpha=0.2, variant="hf", client_optimizer=SGD())
    data = data._replace(schedules={"meta": (data.batches[:6], data.batch_mask[:6])})
    for algorithm in (hf, dataclasses.replace(hf, variant="fo", client_optimizer=SGD(0.01))):
        state = algorithm.init_client(params, None, CTX)
        reference, fused, counts = fused_and_autograd(algorithm, params, state, data)
        assert counts.fused == 0 and counts.autograd > 0
        assert_same_update(reference, fused)
        assert not fuses(algorithm, params, state, data, CTX)


@pytest.mark.parametrize("name", ["mlp", "conv"])
def test_pgfed_full_gradient_fused_equals_autograd(name):
    """PGFed's upload g_i and f_i at the final model: one fused step on a row of every sample
    gives the chunked autograd mean gradient and loss (label mask included)."""
    model, params, x, y = setting(name)
    data = client(x, y, 4, 1.0)
    algorithm = PGFed(model=model)
    grad, loss = algorithm.full_gradient(params, data)
    with fused_steps() as counts:
        fused_grad, fused_loss = algorithm.full_gradient(params, data)
    assert (counts.fused, counts.autograd) == (1, 0)
    assert fused_grad.keys() == grad.keys()
    for k in grad:
        torch.testing.assert_close(fused_grad[k], grad[k], atol=1e-10, rtol=1e-9, msg=k)
    torch.testing.assert_close(fused_loss, loss, atol=1e-10, rtol=1e-9)
