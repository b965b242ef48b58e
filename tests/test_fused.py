"""Fused SGD steps equal autograd's, and fall back to it wherever they do not apply."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from torch import nn
from torch.func import vmap

from pflego.algorithms.pfedme import PFedMe
from pflego.fused import fused_sgd_steps
from pflego.local import fused_steps, train_steps
from pflego.loss import CrossEntropy, Linear, Objective
from pflego.loss import Proximal as ProximalTerm
from pflego.models import SplitModel, apply_layers, build_model, channels_last, init_head
from pflego.optim import SGD, Momentum, Proximal
from pflego.sim.backends import fuses
from pflego.sim.clients import schedule
from pflego.types import ClientData, RoundContext


def conv_model() -> SplitModel:
    """Every layer kind the kernel knows: a padded grayscale conv (the unfold shortcut at
    evaluation), tiling and overlapping max-pools, a bias-free linear layer."""
    body = nn.Sequential(
        nn.Conv2d(1, 4, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Sequential(nn.Conv2d(4, 5, 2, stride=1), nn.ReLU(), nn.MaxPool2d(3, 2)),
        nn.Flatten(),
        nn.Linear(5, 7, bias=False),
        nn.ReLU(),
        nn.Identity(),
    )
    return SplitModel(body.double().requires_grad_(False), 7, 3, 3, "test-conv")


def rgb_conv_model() -> SplitModel:
    """Three input channels: inputs and activations stored channels-last differ from ``NCHW``."""
    body = nn.Sequential(
        nn.Conv2d(3, 4, 3), nn.ReLU(), nn.MaxPool2d(2), nn.Conv2d(4, 5, 2), nn.Flatten()
    )
    return SplitModel(body.double().requires_grad_(False), 5, 3, 3, "test-rgb-conv")


MODELS = {
    "mlp": (lambda: build_model("mlp", (1, 3, 3), 3, 3), (1, 3, 3)),
    "conv": (conv_model, (1, 8, 8)),
    "rgb-conv": (rgb_conv_model, (3, 7, 7)),
    "head": (lambda: None, (6,)),
}


def setting(name: str, seed: int = 0):
    """A model, its float64 parameters and one ragged client's data (13 samples)."""
    make, shape = MODELS[name]
    model = make()
    gen = torch.Generator().manual_seed(seed)
    width = 3
    params = {}
    if model is not None:
        for k, v in model.body.named_parameters():
            params[f"body.{k}"] = torch.randn(v.shape, generator=gen, dtype=torch.float64) * 0.5
    feature_dim = 6 if model is None else model.feature_dim
    params |= init_head(width, feature_dim, gen, dtype=torch.float64)
    n = 13
    x = torch.randn((n, *shape), generator=gen, dtype=torch.float64)
    y = torch.randint(0, 2, (n,), generator=gen)  # the third class is masked out
    return model, params, x, y


def client(x: torch.Tensor, y: torch.Tensor, batch_size: int | None, epochs: float) -> ClientData:
    idx, mask = schedule(len(y), 4, batch_size, epochs, np.random.default_rng(3))
    mask = mask.double()
    if batch_size is not None:
        mask[1] = 0  # an empty step in the middle changes nothing
    return ClientData(
        x=x,
        y=y,
        mask=torch.ones(len(y), dtype=torch.float64),
        batches=idx,
        batch_mask=mask,
        label_mask=torch.tensor([1.0, 1.0, 0.0], dtype=torch.float64),
        num_samples=torch.tensor(float(len(y)), dtype=torch.float64),
    )


def both(loss: Objective, params, data, optimizer, steps=slice(None)):
    reference = train_steps(loss, params, data, optimizer, optimizer.init(params), 0.3, steps)
    with fused_steps() as counts:
        fused = train_steps(loss, params, data, optimizer, optimizer.init(params), 0.3, steps)
    return reference, fused, counts


@pytest.mark.parametrize("name", ["mlp", "conv", "head"])
@pytest.mark.parametrize("trained", ["all", "head", "body"])
@pytest.mark.parametrize("terms", ["plain", "proximal", "linear", "weight-decay", "weighted"])
@pytest.mark.parametrize("batch_size", [4, None])
def test_fused_steps_equal_autograd(name, trained, terms, batch_size):
    model, params, x, y = setting(name)
    if name == "head" and trained == "body":
        pytest.skip("a bare head has no body")
    keys = {"all": params, "head": {k for k in params if k.startswith("head.")}}
    keys["body"] = {k for k in params if k.startswith("body.")}
    train = {k: v for k, v in params.items() if k in keys[trained]}
    fixed = {k: v for k, v in params.items() if k not in train}
    gen = torch.Generator().manual_seed(9)
    other = {k: torch.randn(v.shape, generator=gen, dtype=v.dtype) for k, v in train.items()}
    extra = {
        "plain": (CrossEntropy(),),
        "proximal": (CrossEntropy(), ProximalTerm(other, 0.7)),
        "linear": (CrossEntropy(), Linear(other)),
        "weight-decay": (CrossEntropy(),),
        "weighted": (CrossEntropy(torch.rand(13, generator=gen, dtype=torch.float64)),),
    }[terms]
    optimizer = SGD(weight_decay=0.1 if terms == "weight-decay" else 0.0)
    data = client(x, y, batch_size, 2.0)
    loss = Objective(model, data.label_mask, fixed=fixed, terms=extra)
    (ref, _, ref_loss), (out, _, out_loss), counts = both(loss, train, data, optimizer)
    assert (counts.fused, counts.autograd) == (1, 0)
    for k in ref:
        torch.testing.assert_close(out[k], ref[k], atol=1e-10, rtol=1e-9, msg=k)
    torch.testing.assert_close(out_loss, ref_loss, atol=1e-10, rtol=1e-9)
    assert all(not torch.equal(out[k], train[k]) for k in train)  # it trained
    assert all(v is not out[k] for k, v in train.items())  # on copies


@pytest.mark.parametrize("terms", ["plain", "proximal"])
@pytest.mark.parametrize("batch_size", [4, None])
def test_channels_last_steps_on_several_input_channels_equal_autograd(terms, batch_size):
    model, params, x, y = setting("rgb-conv")
    data = client(x, y, batch_size, 2.0)
    anchor = {k: v * 0.5 for k, v in params.items()}
    extra = (ProximalTerm(anchor, 0.7),) if terms == "proximal" else ()
    loss = Objective(model, data.label_mask, terms=(CrossEntropy(), *extra))
    (ref, _, ref_loss), (out, _, out_loss), counts = both(loss, params, data, SGD())
    assert (counts.fused, counts.autograd) == (1, 0)
    for k in ref:
        torch.testing.assert_close(out[k], ref[k], atol=1e-10, rtol=1e-9, msg=k)
        assert out[k].is_contiguous()  # handed back in the model's layout
    torch.testing.assert_close(out_loss, ref_loss, atol=1e-10, rtol=1e-9)


@pytest.mark.parametrize("channels", [1, 3])
def test_channels_last_keeps_the_values_and_says_its_layout(channels):
    x = torch.randn(2, 4, channels, 5, 6)
    stored = channels_last(x)
    assert torch.equal(stored, x)
    assert stored.stride()[-3:] == (1, 6 * channels, channels)  # even for one channel
    assert stored[1].is_contiguous(memory_format=torch.channels_last)


def test_sample_weights_weigh_each_samples_cross_entropy():
    """Against a loss written out by hand: sum_s w_s mask_s CE_s / sum_s mask_s."""
    model, params, x, y = setting("mlp")
    data = client(x, y, 4, 1.0)
    weights = torch.rand(len(y), generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    loss = Objective(model, data.label_mask, terms=(CrossEntropy(weights),))
    idx, mask = data.batches[-1], data.batch_mask[-1]
    logits = model.forward(params, x[idx]).masked_fill(data.label_mask == 0, -torch.inf)
    by_hand = -(torch.log_softmax(logits, -1)[torch.arange(len(idx)), y[idx]])
    expected = (by_hand * weights[idx] * mask).sum() / mask.sum()
    torch.testing.assert_close(loss.on_samples(idx)(params, x[idx], y[idx], mask), expected)


def test_a_slice_of_the_steps_and_no_steps():
    model, params, x, y = setting("mlp")
    data = client(x, y, 4, 1.0)
    loss = Objective(model, data.label_mask)
    for steps in (slice(0, -1), slice(0, 0)):
        (ref, _, ref_loss), (out, _, out_loss), _ = both(loss, params, data, SGD(), steps)
        for k in ref:
            torch.testing.assert_close(out[k], ref[k], atol=1e-10, rtol=1e-9)
        torch.testing.assert_close(out_loss, ref_loss, atol=1e-12, rtol=0)


def test_what_does_not_fuse_runs_autograd():
    model, params, x, y = setting("mlp")
    data = client(x, y, 4, 1.0)
    loss = Objective(model, data.label_mask)
    closure = lambda p, xb, yb, m: loss(p, xb, yb, m)  # noqa: E731
    cases = [
        (closure, params, SGD()),  # an undeclared loss
        (loss, params, Momentum()),  # another optimizer
        (loss, {k: v.clone().requires_grad_() for k, v in params.items()}, SGD()),  # tracked
    ]
    for fn, p, opt in cases:
        with fused_steps() as counts:
            train_steps(fn, p, data, opt, opt.init(p), 0.1)
        assert (counts.fused, counts.autograd) == (0, 1)
    lstm = Objective(build_model("lstm", (5,), 3, 3), data.label_mask)  # other modules
    assert fused_sgd_steps(lstm, params, data, SGD(), 0.1) is None

    def one(p, xb, yb):  # under vmap the tensors are wrapped: autograd, vectorized
        d = data._replace(x=xb, y=yb)
        return train_steps(loss, p, d, SGD(), {}, 0.1)[0]

    with fused_steps() as counts:
        vmap(one, in_dims=(None, 0, 0))(params, x.expand(2, *x.shape), y.expand(2, -1))
    assert counts.fused == 0


@pytest.mark.parametrize("name", ["mlp", "conv"])
def test_evaluation_shortcuts_compute_what_the_modules_compute(name):
    model, params, x, _ = setting(name)
    module = model.body.double()
    module.load_state_dict({k[5:]: v for k, v in params.items() if k.startswith("body.")})
    with torch.no_grad():
        expected = module(x)
        torch.testing.assert_close(apply_layers(model.layers, params, x), expected)
        batched = vmap(lambda xb: apply_layers(model.layers, params, xb))(x.expand(2, *x.shape))
        torch.testing.assert_close(batched[1], expected)
    torch.testing.assert_close(apply_layers(model.layers, params, x), expected)  # with autograd


@pytest.mark.parametrize("name", ["conv", "rgb-conv"])
def test_evaluation_under_vmap_of_per_client_bodies_equals_each_clients_own(name):
    """Per-client convolutional bodies under vmap run client by client (one operator whose vmap
    rule loops): the features of each client's own parameters, for batched and shared bodies."""
    model, params, x, _ = setting(name)
    clients = [setting(name, seed)[1] for seed in range(3)]
    stacked = {k: torch.stack([p[k] for p in clients]) for k in params}
    inputs = torch.stack([x, x.flip(0), x * 2])
    forward = lambda p, xb: apply_layers(model.layers, p, xb)  # noqa: E731
    with torch.no_grad():
        batched = vmap(forward)(stacked, inputs)
        shared = vmap(forward, in_dims=(None, 0))(params, inputs)
        for i, p in enumerate(clients):
            torch.testing.assert_close(batched[i], forward(p, inputs[i]))
            torch.testing.assert_close(shared[i], forward(params, inputs[i]))
        nested = vmap(vmap(forward))(
            {k: v.expand(2, *v.shape) for k, v in stacked.items()}, inputs.expand(2, *inputs.shape)
        )
        torch.testing.assert_close(nested[1], batched)


@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
def test_a_proximal_optimizer_fuses_and_logs_the_loss_without_its_term(weight_decay):
    """``Proximal(SGD)`` on a declared loss: the same steps as autograd, and the logged value is
    the loss's alone, as the autograd path logs it."""
    model, params, x, y = setting("mlp")
    data = client(x, y, 4, 2.0)
    gen = torch.Generator().manual_seed(4)
    anchor = {k: torch.randn(v.shape, generator=gen, dtype=v.dtype) for k, v in params.items()}
    solver = Proximal(SGD(weight_decay=weight_decay), 0.7, anchor)
    (ref, _, ref_loss), (out, _, out_loss), counts = both(
        Objective(model, data.label_mask), params, data, solver
    )
    assert (counts.fused, counts.autograd) == (1, 0)
    for k in ref:
        torch.testing.assert_close(out[k], ref[k], atol=1e-10, rtol=1e-9, msg=k)
    torch.testing.assert_close(out_loss, ref_loss, atol=1e-10, rtol=1e-9)
    with fused_steps() as counts:  # a loss with its own proximal term, or momentum: autograd
        proximal = Objective(
            model, data.label_mask, terms=(CrossEntropy(), ProximalTerm(anchor, 0.1))
        )
        train_steps(proximal, params, data, solver, {}, 0.3)
        inner = Proximal(Momentum(), 0.7, anchor)
        train_steps(Objective(model, data.label_mask), params, data, inner, inner.init(params), 0.3)
    assert (counts.fused, counts.autograd) == (0, 2)


@pytest.mark.parametrize("name", ["mlp", "conv"])
def test_pfedme_rounds_fused_equal_autograd_and_fuses_says_so(name):
    """pFedMe's R local iterations of K prox steps each, the anchor moving after each: fused,
    in one call, as with autograd."""
    model, params, x, y = setting(name)
    data = client(x, y, 4, 2.0)
    algorithm = PFedMe(model=model, lam=3.0, K=3, personal_lr=0.05, client_optimizer=SGD(0.01))
    ctx = RoundContext(0, 1, 1.0, 13, 0.2, 1.0)
    state = algorithm.init_client(params, None, ctx)
    ref_out, ref_state = algorithm.client_update(params, state, data, ctx)
    with fused_steps() as counts:
        out, new_state = algorithm.client_update(params, state, data, ctx)
    assert (counts.fused, counts.autograd) == (1, 0)  # all R iterations in one call
    for got, expected in ((out.upload, ref_out.upload), (new_state, ref_state)):
        for k in expected:
            torch.testing.assert_close(got[k], expected[k], atol=1e-10, rtol=1e-9, msg=k)
    torch.testing.assert_close(out.metrics["loss"], ref_out.metrics["loss"], atol=1e-10, rtol=1e-9)
    assert not torch.equal(out.upload["head.weight"], torch.zeros_like(params["head.weight"]))
    assert fuses(algorithm, params, state, data, ctx)
    assert not fuses(
        dataclasses.replace(algorithm, client_optimizer=Momentum()), params, state, data, ctx
    )


@pytest.mark.parametrize("name", ["pfedme", "pgfed"])
def test_another_optimizer_steps_as_the_sgd_program_does(name):
    """pFedMe's and PGFed's steps with momentum 0 (their own autograd steps, anchor moves and
    iterate sums) end where plain SGD's step programs end, fused or not."""
    from pflego import tree
    from pflego.algorithms.pgfed import PGFed

    model, params, x, y = setting("mlp")
    data = client(x, y, 4, 2.0)
    ctx = RoundContext(0, 1, 1.0, 13, 0.2, 1.0)
    if name == "pfedme":
        algorithm = PFedMe(model=model, lam=3.0, K=3, personal_lr=0.05)
        downlink = params
    else:
        algorithm = PGFed(model=model)
        downlink = {**params, **tree.add_prefix("aux.", tree.scale(params, 0.1))}
    outs = {}
    for optimizer in (SGD(0.01), Momentum(0.0, 0.01)):
        moved = dataclasses.replace(algorithm, client_optimizer=optimizer)
        state = moved.init_client(downlink, None, ctx)
        for fused in (False, True):
            with fused_steps(fused):
                outs[type(optimizer), fused] = moved.client_update(downlink, state, data, ctx)
    reference = outs[SGD, False]
    for out, new_state in outs.values():
        for got, expected in ((out.upload, reference[0].upload), (new_state, reference[1])):
            for k in expected:
                torch.testing.assert_close(got[k], expected[k], atol=1e-10, rtol=1e-9, msg=k)
        torch.testing.assert_close(out.metrics["loss"], reference[0].metrics["loss"])
