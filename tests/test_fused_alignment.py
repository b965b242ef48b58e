"""The feature-alignment term of an Objective (FedPAC's, FedProto's, FedAS's) equals its definition,
runs as fused steps equal to autograd's, and makes those methods' local steps fuse."""

from __future__ import annotations

import pytest
import torch
from test_fused import both, client, setting

from pflego.algorithms.fedas import FedAS
from pflego.algorithms.fedpac import FedPAC
from pflego.algorithms.fedproto import FedProto
from pflego.local import fused_steps
from pflego.loss import Alignment, CrossEntropy, Objective, Proximal
from pflego.optim import SGD
from pflego.sim.backends import fuses
from pflego.types import RoundContext

CTX = RoundContext(0, 1, 1.0, 13, 0.2, 1.0)


def centroids_for(model, seed: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    """Random centroids ``[3, M]`` and class weights, the second class's zero."""
    gen = torch.Generator().manual_seed(seed)
    width = model.feature_dim
    centroids = torch.randn((3, width), generator=gen, dtype=torch.float64)
    return centroids, torch.tensor([0.8, 0.0, 0.3], dtype=torch.float64)


def test_the_alignment_term_is_its_definition():
    """Against the term written out by hand over the rows (a padded row counts for nothing)."""
    model, params, x, y = setting("mlp")
    centroids, weights = centroids_for(model)
    mask = torch.ones(len(y), dtype=torch.float64)
    mask[[2, 7]] = 0
    plain = Objective(model, torch.ones(3, dtype=torch.float64))
    aligned = Objective(
        model, plain.label_mask, terms=(CrossEntropy(), Alignment(centroids, weights))
    )
    features = model.features(params, x)
    by_hand = (
        sum(
            mask[s] * weights[y[s]] * ((features[s] - centroids[y[s]]) ** 2).sum()
            for s in range(len(y))
        )
        / mask.sum()
    )
    torch.testing.assert_close(
        aligned(params, x, y, mask) - plain(params, x, y, mask), by_hand, rtol=1e-12, atol=1e-12
    )


def test_class_means_sum_each_classes_mean_without_cross_entropy():
    """FedAS's term by hand: for each class in the minibatch, the mean over its real rows."""
    model, params, x, y = setting("mlp")
    centroids, weights = centroids_for(model)
    mask = torch.ones(len(y), dtype=torch.float64)
    mask[[2, 7]] = 0
    loss = Objective(
        model, torch.ones(3, dtype=torch.float64), terms=(Alignment(centroids, weights, True),)
    )
    features = model.features(params, x)
    by_hand = 0.0
    for c in range(3):
        rows = [s for s in range(len(y)) if y[s] == c and mask[s] > 0]
        gaps = [weights[c] * ((features[s] - centroids[c]) ** 2).sum() for s in rows]
        by_hand = by_hand + (sum(gaps) / len(rows) if rows else 0.0)
    torch.testing.assert_close(loss(params, x, y, mask), by_hand, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("name", ["mlp", "conv"])
@pytest.mark.parametrize("batch_size", [4, None])
def test_headless_class_mean_steps_fused_equal_autograd(name, batch_size):
    """FedAS's alignment: the body alone, no cross-entropy, each class's rows averaged."""
    model, params, x, y = setting(name)
    body = {k: v for k, v in params.items() if k.startswith("body.")}
    centroids, weights = centroids_for(model)
    data = client(x, y, batch_size, 2.0)
    loss = Objective(model, data.label_mask, terms=(Alignment(centroids, weights, True),))
    (ref, _, ref_loss), (out, _, out_loss), counts = both(loss, body, data, SGD())
    assert (counts.fused, counts.autograd) == (1, 0)
    for k in ref:
        torch.testing.assert_close(out[k], ref[k], atol=1e-10, rtol=1e-9, msg=k)
    torch.testing.assert_close(out_loss, ref_loss, atol=1e-10, rtol=1e-9)
    assert any(not torch.equal(out[k], body[k]) for k in body)


@pytest.mark.parametrize("name", ["mlp", "conv"])
@pytest.mark.parametrize("trained", ["all", "body"])
@pytest.mark.parametrize("batch_size", [4, None])
@pytest.mark.parametrize("others", [False, True], ids=["alone", "with-other-terms"])
def test_aligned_steps_fused_equal_autograd(name, trained, batch_size, others):
    """13 rows (the last minibatch padded, one step empty), float64, with and without the
    proximal term, sample weights and weight decay beside it."""
    model, params, x, y = setting(name)
    train = {k: v for k, v in params.items() if trained == "all" or k.startswith("body.")}
    fixed = {k: v for k, v in params.items() if k not in train}
    centroids, weights = centroids_for(model)
    gen = torch.Generator().manual_seed(9)
    extra = (CrossEntropy(),)
    if others:
        anchor = {k: torch.randn(v.shape, generator=gen, dtype=v.dtype) for k, v in train.items()}
        samples = torch.rand(len(y), generator=gen, dtype=torch.float64)
        extra = (CrossEntropy(samples), Proximal(anchor, 0.7))
    data = client(x, y, batch_size, 2.0)
    loss = Objective(
        model, data.label_mask, fixed, (extra[0], Alignment(centroids, weights), *extra[1:])
    )
    optimizer = SGD(weight_decay=0.1 if others else 0.0)
    (ref, _, ref_loss), (out, _, out_loss), counts = both(loss, train, data, optimizer)
    assert (counts.fused, counts.autograd) == (1, 0)
    for k in ref:
        torch.testing.assert_close(out[k], ref[k], atol=1e-10, rtol=1e-9, msg=k)
    torch.testing.assert_close(out_loss, ref_loss, atol=1e-10, rtol=1e-9)
    unaligned = Objective(model, data.label_mask, fixed, extra)
    (plain, _, _), _, _ = both(unaligned, train, data, optimizer)
    assert any(not torch.allclose(plain[k], ref[k]) for k in train if k.startswith("body."))


def test_aligning_a_bare_heads_input_runs_autograd():
    """Without a model the features are the input, which no step changes: autograd."""
    _, params, x, y = setting("head")
    data = client(x, y, 4, 1.0)
    alignment = Alignment(
        torch.zeros((3, 6), dtype=torch.float64), torch.ones(3, dtype=torch.float64)
    )
    loss = Objective(None, data.label_mask, terms=(CrossEntropy(), alignment))
    (ref, _, ref_loss), (out, _, out_loss), counts = both(loss, params, data, SGD())
    assert (counts.fused, counts.autograd) == (0, 1)
    torch.testing.assert_close(out_loss, ref_loss)


def prototype_client(name: str):
    """A model, float64 parameters and a client with ``head`` and ``body`` schedules."""
    model, params, x, y = setting(name)
    data = client(x, y, 4, 1.0)
    data = data._replace(
        schedules={"head": (data.batches, data.batch_mask), "body": (data.batches, data.batch_mask)}
    )
    gen = torch.Generator().manual_seed(6)
    protos = {
        "proto.mean": torch.randn((3, model.feature_dim), generator=gen, dtype=torch.float64),
        "proto.present": torch.tensor([1.0, 0.0, 1.0], dtype=torch.float64),
    }
    return model, params, protos, data


def assert_fused_equal_autograd(algorithm, downlink, state, data) -> None:
    reference = algorithm.client_update(downlink, state, data, CTX)
    with fused_steps() as counts:
        fused = algorithm.client_update(downlink, state, data, CTX)
    assert counts.fused > 0 and counts.autograd == 0
    assert fuses(algorithm, downlink, state, data, CTX)
    (ref_out, ref_state), (out, new_state) = reference, fused
    for got, expected in ((out.upload, ref_out.upload), (new_state, ref_state)):
        assert got.keys() == expected.keys()
        for k in expected:
            torch.testing.assert_close(got[k], expected[k], atol=1e-10, rtol=1e-9, msg=k)
    for k in ref_out.metrics:
        torch.testing.assert_close(out.metrics[k], ref_out.metrics[k], atol=1e-10, rtol=1e-9)
    torch.testing.assert_close(out.weight, ref_out.weight, atol=1e-10, rtol=1e-9)


@pytest.mark.parametrize("name", ["mlp", "conv"])
def test_fedpac_local_steps_fuse_and_equal_autograd(name):
    model, params, protos, data = prototype_client(name)
    algorithm = FedPAC(model=model, lam=0.7)
    assert_fused_equal_autograd(algorithm, params | protos, {}, data)


@pytest.mark.parametrize("name", ["mlp", "conv"])
def test_fedproto_local_steps_fuse_and_equal_autograd(name):
    model, params, protos, data = prototype_client(name)
    algorithm = FedProto(model=model, lam=0.7)
    state = algorithm.init_client(params, None, CTX)
    assert_fused_equal_autograd(algorithm, params | protos, state, data)


@pytest.mark.parametrize("name", ["mlp", "conv"])
def test_fedas_local_steps_fuse_and_equal_autograd(name):
    """A revisiting client (its own body, the prototypes' source, differs from the received
    one); the Fisher trace, its aggregation weight, by fused gradients too."""
    model, params, _, data = prototype_client(name)
    data = data._replace(
        schedules={
            "align": (data.batches, data.batch_mask),
            "fisher": (data.batches, data.batch_mask),
        }
    )
    algorithm = FedAS(model=model, align_lr=0.3)
    state = algorithm.init_client(params, torch.Generator().manual_seed(1), CTX)
    _, state = algorithm.client_update(params, state, data, CTX)
    assert_fused_equal_autograd(algorithm, params, state, data)
