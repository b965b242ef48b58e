"""Step programs (pflego.program): the fused kernel runs a program as the autograd interpreter
does (float64, 1e-10), the autograd interpreter runs under vmap as client by client, and an
objective's terms fuse where each has a fused form and run autograd where one has none."""

from __future__ import annotations

import pytest
import torch
from test_fused import client, setting
from torch.func import vmap

from pflego.fused_bilevel import fused_program, kernel_steps
from pflego.local import fused_steps, run_program, train_steps
from pflego.loss import Alignment, Batch, CrossEntropy, FusedForm, Linear, Objective, Proximal, Term
from pflego.optim import SGD, Momentum
from pflego.program import Step, autograd_program
from pflego.types import ClientData


def program(rows: int) -> list[Step]:
    """Every kind of step on three points: a mix with a tensor weight, a copy, a gradient taken
    at one point that updates another with shrinkage, a gated step and recorded norms."""
    weight = torch.tensor(0.3, dtype=torch.float64)
    steps = []
    for row in range(rows):
        steps += [
            Step(0, 0, 0.2, 0.99, row, ((2, 0, 1, weight),)),  # w at w; v-bar <- w + 0.3 (v - w)
            Step(2, 1, 0.2 * weight, 1.0, row, record=True),  # v at v-bar
            Step(2, 2, 0.1, 1.0, row, ((2, 1, 1, 0.0),), gate=((row + 1) % rows,)),  # copy of v
        ]
    return steps


def points_for(params):
    gen = torch.Generator().manual_seed(1)
    other = {
        k: v + 0.1 * torch.randn(v.shape, generator=gen, dtype=v.dtype) for k, v in params.items()
    }
    return [params, other, params]


@pytest.mark.parametrize("name", ["mlp", "conv"])
@pytest.mark.parametrize("batch_size", [4, None])
def test_a_program_runs_fused_as_by_autograd(name, batch_size):
    """13 ragged rows, an empty schedule row (its steps, and the gated step before it, skip)."""
    model, params, x, y = setting(name)
    data = client(x, y, batch_size, 2.0)
    loss = Objective(model, data.label_mask)
    steps = program(data.batches.shape[0])
    reference = autograd_program(loss, points_for(params), data, steps)
    fused = fused_program(loss, points_for(params), data, steps)
    assert fused is not None
    for got, expected in zip(fused.points, reference.points, strict=True):
        for k in expected:
            torch.testing.assert_close(got[k], expected[k], atol=1e-10, rtol=1e-10, msg=k)
    for field in ("values", "active", "norms"):
        torch.testing.assert_close(
            getattr(fused, field), getattr(reference, field), atol=1e-10, rtol=1e-10
        )
    if batch_size is not None:  # row 1 is empty: its steps and the gated step of row 0 skip
        assert reference.active[[2, 3, 4, 5]].tolist() == [0.0, 0.0, 0.0, 0.0]
    assert reference.norms[1] > 0 and reference.values[0] > 0
    with fused_steps() as counts:
        run_program(loss, points_for(params), data, steps)
    assert (counts.fused, counts.autograd) == (1, 0)


def test_a_program_of_numbers_is_encoded_once_and_one_with_tensors_never():
    """A program whose weights are all numbers (a pull, a scale, a sum) runs its second time on
    the kernel arguments of its first, to the same bits; one with a tensor weight is not kept."""
    model, params, x, y = setting("mlp")
    data = client(x, y, 4, 2.0)
    loss = Objective(model, data.label_mask)
    rows = range(data.batches.shape[0])
    steps = [Step(0, 0, 0.1, 1.0, r, ((2, 0, 1.0),), pulls=((1, 0.5),), scale=0.7) for r in rows]
    kernel_steps.cache_clear()
    first, second = (fused_program(loss, points_for(params), data, steps) for _ in range(2))
    info = kernel_steps.cache_info()
    assert (info.misses, info.hits, info.currsize) == (1, 1, 1)
    for got, expected in zip(second.points, first.points, strict=True):
        assert all(torch.equal(got[k], expected[k]) for k in expected)
    assert torch.equal(second.values, first.values)
    reference = autograd_program(loss, points_for(params), data, steps)
    for got, expected in zip(first.points, reference.points, strict=True):
        for k in expected:
            torch.testing.assert_close(got[k], expected[k], atol=1e-10, rtol=1e-10, msg=k)
    assert fused_program(loss, points_for(params), data, program(len(rows))) is not None
    assert kernel_steps.cache_info().currsize == 1


def test_the_autograd_interpreter_runs_under_vmap_as_client_by_client():
    """Two clients stacked, their schedules ragged: static shapes, no host synchronization."""
    model, params, x, y = setting("mlp")
    datas = [client(x, y, 4, 2.0), client(x, y, 4, 1.0)]
    rows = datas[0].batches.shape[0]
    datas[1] = datas[1]._replace(
        batches=torch.cat([datas[1].batches, datas[1].batches])[:rows],
        batch_mask=torch.cat([datas[1].batch_mask, torch.zeros_like(datas[1].batch_mask)])[:rows],
    )
    loss = Objective(model, datas[0].label_mask)
    steps = program(rows)
    each = [autograd_program(loss, points_for(params), d, steps) for d in datas]
    names = ("x", "y", "mask", "batches", "batch_mask", "label_mask", "num_samples")
    stacked = [torch.stack([getattr(d, name) for d in datas]) for name in names]

    start = points_for(params)

    def one(*tensors):
        out = autograd_program(loss, start, ClientData(*tensors), steps)
        return out.points, out.values, out.norms

    points, values, norms = vmap(one)(*stacked)
    for c, outcome in enumerate(each):
        torch.testing.assert_close(values[c], outcome.values, atol=1e-12, rtol=1e-12)
        torch.testing.assert_close(norms[c], outcome.norms, atol=1e-12, rtol=1e-12)
        for p, expected in zip(points, outcome.points, strict=True):
            for k in expected:
                torch.testing.assert_close(p[k][c], expected[k], atol=1e-12, rtol=1e-12)


def test_a_program_on_another_loss_runs_autograd():
    model, params, x, y = setting("mlp")
    data = client(x, y, 4, 1.0)
    terms = (CrossEntropy(), Proximal({k: v * 0 for k, v in params.items()}, 0.1))
    loss = Objective(model, data.label_mask, terms=terms)
    with fused_steps() as counts:
        out = run_program(loss, points_for(params), data, program(data.batches.shape[0]))
    assert (counts.fused, counts.autograd) == (0, 1)
    assert out.active.sum() > 0


@pytest.mark.parametrize("term", ["cross-entropy", "weighted", "proximal", "linear", "alignment"])
def test_each_terms_fused_form_trains_as_its_autograd_value(term):
    """One term beside the cross-entropy (or alone), float64, ragged minibatches."""
    model, params, x, y = setting("conv")
    data = client(x, y, 4, 2.0)
    gen = torch.Generator().manual_seed(7)
    other = {k: torch.randn(v.shape, generator=gen, dtype=v.dtype) for k, v in params.items()}
    extra = {
        "cross-entropy": (),
        "weighted": None,
        "proximal": (Proximal(other, 0.4),),
        "linear": (Linear(other),),
        "alignment": (
            Alignment(
                torch.randn(3, 7, generator=gen, dtype=torch.float64),
                torch.rand(3, generator=gen, dtype=torch.float64),
            ),
        ),
    }[term]
    terms = (
        (CrossEntropy(torch.rand(13, generator=gen, dtype=torch.float64)),)
        if extra is None
        else (CrossEntropy(), *extra)
    )
    loss = Objective(model, data.label_mask, terms=terms)
    assert loss.fused_form() is not None
    reference = train_steps(loss, params, data, SGD(), {}, 0.3)
    with fused_steps() as counts:
        fused = train_steps(loss, params, data, SGD(), {}, 0.3)
    assert (counts.fused, counts.autograd) == (1, 0)
    for k in params:
        torch.testing.assert_close(fused[0][k], reference[0][k], atol=1e-10, rtol=1e-10, msg=k)
    torch.testing.assert_close(fused[2], reference[2], atol=1e-10, rtol=1e-10)


class Entropy(Term):
    """A term without a fused form: the mean entropy of the features' softmax."""

    def value(self, batch: Batch) -> torch.Tensor:
        p = torch.softmax(batch.features, -1)
        return -((p * p.log()).sum(-1) * batch.mask).sum() / batch.count


def test_a_term_without_a_fused_form_runs_autograd_and_adds_its_value():
    model, params, x, y = setting("mlp")
    data = client(x, y, 4, 1.0)
    loss = Objective(model, data.label_mask, terms=(CrossEntropy(), Entropy()))
    plain = Objective(model, data.label_mask)
    assert loss.fused_form() is None
    idx, mask = data.batches[0], data.batch_mask[0]
    batch = (params, x[idx], y[idx], mask)
    features = model.features(params, x[idx])
    own = Entropy().value(Batch(params, params, features, y[idx], mask, mask.sum(), None))
    torch.testing.assert_close(loss(*batch), plain(*batch) + own)
    with fused_steps() as counts:
        train_steps(loss, params, data, SGD(), {}, 0.3)
    assert (counts.fused, counts.autograd) == (0, 1)


def test_fused_forms_merge_and_refuse_a_second_term_of_a_kind():
    anchor = {"w": torch.zeros(2)}
    form = Objective(
        None, torch.ones(2), terms=(CrossEntropy(), Proximal(anchor, 0.5))
    ).fused_form()
    assert form == FusedForm(cross_entropy=True, anchor=anchor, strength=0.5)
    twice = Objective(None, torch.ones(2), terms=(Proximal(anchor, 0.5), Proximal(anchor, 0.1)))
    assert twice.fused_form() is None


def test_an_algorithm_declares_its_objective_unless_it_writes_its_own_loss():
    """The model's cross-entropy as an Objective (its steps fuse); a subclass's own ``loss`` (and
    its subclasses') as a function of it, which autograd differentiates."""
    from dataclasses import dataclass

    from pflego.algorithms.fedavg import FedAvg

    @dataclass(frozen=True)
    class Doubled(FedAvg):
        def loss(self, params, x, y, mask, label_mask):
            return 2 * super().loss(params, x, y, mask, label_mask)

    @dataclass(frozen=True)
    class Inherited(Doubled):
        pass

    model, params, x, y = setting("mlp")
    data = client(x, y, 4, 1.0)
    assert isinstance(FedAvg(model=model).model_objective(data.label_mask), Objective)
    plain = FedAvg(model=model).model_objective(data.label_mask)
    for cls in (Doubled, Inherited):
        own = cls(model=model).model_objective(data.label_mask)
        assert not isinstance(own, Objective)
        batch = (params, x[:4], y[:4], torch.ones(4, dtype=torch.float64))
        torch.testing.assert_close(own(*batch), 2 * plain(*batch))
        with fused_steps() as counts:
            train_steps(own, params, data, SGD(), {}, 0.3)
        assert (counts.fused, counts.autograd) == (0, 1)


def test_a_program_of_no_steps_changes_nothing():
    """A Per-FedAvg client with fewer rows than a meta-step: no step, by either interpreter."""
    model, params, x, y = setting("mlp")
    data = client(x, y, 4, 1.0)
    loss = Objective(model, data.label_mask)
    for fused in (False, True):
        with fused_steps(fused):
            out = run_program(loss, [params], data, [])
        assert out.values.shape == out.active.shape == out.norms.shape == (0,)
        assert out.mean_value() == 0
        for k in params:
            torch.testing.assert_close(out.points[0][k], params[k])


@pytest.mark.parametrize("name", ["mlp", "conv"])
def test_sums_and_mixes_after_the_update_run_fused_as_by_autograd_and_by_hand(name):
    """A sum of the points the steps start from (before each update), a proximal pull toward a
    second point added to the gradient, and a move of that point toward the first (after every
    second update), with SGD (weight decay) and momentum: both interpreters as a step-by-step
    loop, empty rows changing nothing; the kernel runs SGD only."""
    model, params, x, y = setting(name)
    data = client(x, y, 4, 2.0)
    loss = Objective(model, data.label_mask)
    anchor = {k: v * 0.5 for k, v in params.items()}
    rows, lam, lr, decay = data.batches.shape[0], 0.4, 0.3, 0.1
    steps = [
        Step(0, 0, lr, 1.0, r, ((2, 0, 1.0),), pulls=((0, lam), (1, -lam)),
             after=((1, 1, 0, 0.2),) * (r % 2))
        for r in range(rows)
    ]  # fmt: skip
    for optimizer in (SGD(decay), Momentum(0.9, decay)):
        theta, moved, total = dict(params), dict(anchor), {k: v * 0 for k, v in params.items()}
        buffer = None
        for r in range(rows):
            if data.batch_mask[r].sum() == 0:
                continue
            total = {k: v + theta[k] for k, v in total.items()}
            idx = data.batches[r]
            g = torch.func.grad(loss)(theta, x[idx], y[idx], data.batch_mask[r])
            g = {k: v + (lam + decay) * theta[k] - lam * moved[k] for k, v in g.items()}
            if isinstance(optimizer, Momentum):
                buffer = g if buffer is None else {k: 0.9 * v + g[k] for k, v in buffer.items()}
                g = buffer
            theta = {k: v - lr * g[k] for k, v in theta.items()}
            if r % 2:
                moved = {k: v + 0.2 * (theta[k] - v) for k, v in moved.items()}
        start = [params, anchor, {k: v * 0 for k, v in params.items()}]
        for fused in (False, True):
            with fused_steps(fused) as counts:
                out = run_program(loss, start, data, steps, optimizer)
            assert counts.fused == int(fused and isinstance(optimizer, SGD))
            for got, expected in zip(out.points, (theta, moved, total), strict=True):
                for k in expected:
                    torch.testing.assert_close(got[k], expected[k], atol=1e-10, rtol=1e-10)
    assert not torch.equal(moved["head.weight"], anchor["head.weight"])


@pytest.mark.parametrize("name", ["mlp", "conv"])
def test_a_scaled_gradient_at_a_scratch_point_updates_each_point_with_its_own_state(name):
    """APFL's step: w at w, and v along ``a grad f(v-bar)`` at the scratch mixture ``v-bar = w +
    a (v - w)`` (``None``, returned as ``None``), with SGD (weight decay) and momentum, whose
    buffers are w's and v's own: both interpreters as a step-by-step loop; the kernel runs SGD."""
    model, params, x, y = setting(name)
    data = client(x, y, 4, 2.0)
    loss = Objective(model, data.label_mask)
    v_start = points_for(params)[1]
    rows, lr, decay, a = data.batches.shape[0], 0.3, 0.1, torch.tensor(0.4, dtype=torch.float64)
    steps = []
    for r in range(rows):
        steps += [Step(0, 0, lr, 1.0, r, ((2, 0, 1, a),)), Step(2, 1, lr, 1.0, r, scale=a)]
    for optimizer in (SGD(decay), Momentum(0.9, decay)):
        w, v, buffers = dict(params), dict(v_start), [None, None]
        for r in range(rows):
            if data.batch_mask[r].sum() == 0:
                continue
            idx, mask = data.batches[r], data.batch_mask[r]
            mixed = {k: w[k] + a * (v[k] - w[k]) for k in w}
            moved = []
            for p, (point, at, scale) in enumerate(((w, w, 1.0), (v, mixed, a))):
                g = torch.func.grad(loss)(at, x[idx], y[idx], mask)
                g = {k: scale * t + decay * point[k] for k, t in g.items()}
                if isinstance(optimizer, Momentum):
                    old = buffers[p]
                    buffers[p] = g if old is None else {k: 0.9 * t + g[k] for k, t in old.items()}
                    g = buffers[p]
                moved.append({k: t - lr * g[k] for k, t in point.items()})
            w, v = moved
        for fused in (False, True):
            with fused_steps(fused) as counts:
                out = run_program(loss, [params, v_start, None], data, steps, optimizer)
            assert counts.fused == int(fused and isinstance(optimizer, SGD))
            assert out.points[2] is None
            for got, expected in zip(out.points[:2], (w, v), strict=True):
                for k in expected:
                    torch.testing.assert_close(got[k], expected[k], atol=1e-10, rtol=1e-10)
