"""The functional optimizers follow torch.optim step by step."""

import pytest
import torch

from pflego import tree
from pflego.errors import ConfigError
from pflego.optim import SGD, Adam, Momentum, make_optimizer

CASES = [
    (SGD(), lambda p: torch.optim.SGD(p, lr=0.1)),
    (SGD(weight_decay=0.01), lambda p: torch.optim.SGD(p, lr=0.1, weight_decay=0.01)),
    (Momentum(0.9), lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9)),
    (Momentum(0.5, 0.01), lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.5, weight_decay=0.01)),
    (Adam(), lambda p: torch.optim.Adam(p, lr=0.1)),
    (
        Adam(0.8, 0.99, 1e-6, 0.01),
        lambda p: torch.optim.Adam(p, lr=0.1, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.01),
    ),
]


@pytest.mark.parametrize(("ours", "theirs"), CASES)
def test_matches_torch_optim_for_several_steps(ours, theirs):
    gen = torch.Generator().manual_seed(0)
    start = {
        "a": torch.randn(3, 2, generator=gen, dtype=torch.float64),
        "b": torch.randn(4, generator=gen, dtype=torch.float64),
    }
    reference = {k: v.clone().requires_grad_(True) for k, v in start.items()}
    optimizer = theirs(list(reference.values()))
    params, state = dict(start), ours.init(start)
    for _ in range(5):
        grads = {
            k: torch.randn(v.shape, generator=gen, dtype=torch.float64) for k, v in start.items()
        }
        for k, p in reference.items():
            p.grad = grads[k].clone()
        optimizer.step()
        params, state = ours.update(params, grads, state, 0.1)
        for k in start:
            torch.testing.assert_close(params[k], reference[k].detach(), rtol=1e-12, atol=1e-12)


def test_update_does_not_mutate_inputs():
    params = {"w": torch.ones(3)}
    state = Adam().init(params)
    before = {k: v.clone() for k, v in state.items()}
    Adam().update(params, {"w": torch.ones(3)}, state, 0.1)
    assert torch.equal(params["w"], torch.ones(3))
    assert all(torch.equal(state[k], before[k]) for k in state)


def test_unknown_optimizer_is_a_config_error():
    with pytest.raises(ConfigError, match="unknown optimizer"):
        make_optimizer("rmsprop")


def test_masked_updates_pick_leaves_in_place_outside_vmap_and_choose_per_client_under_it():
    """tree.where, which masked updates use: a plain scalar condition picks the leaves
    themselves (no copy); under vmap each client's condition chooses its own."""
    new, old = {"w": torch.ones(3)}, {"w": torch.zeros(3)}
    assert tree.where(torch.tensor(True), new, old)["w"] is new["w"]
    assert tree.where(torch.tensor(False), new, old)["w"] is old["w"]
    active = torch.tensor([True, False])
    chosen = torch.vmap(lambda c, a, b: tree.where(c, {"w": a}, {"w": b})["w"])(
        active, torch.ones(2, 3), torch.zeros(2, 3)
    )
    assert chosen.tolist() == [[1.0] * 3, [0.0] * 3]
    params, grads = {"w": torch.ones(3)}, {"w": torch.ones(3)}
    state = Adam().init(params)
    kept, kept_state = Adam().masked_update(params, grads, state, 0.1, torch.tensor(False))
    assert kept["w"] is params["w"] and all(kept_state[k] is v for k, v in state.items())
