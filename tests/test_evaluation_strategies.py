"""Evaluation strategies (sim/metrics.py's Evaluator): which one a view gets, and that any two
that apply give the same metrics."""

from __future__ import annotations

import gc
import weakref

import numpy as np
import pytest
import torch
from test_fast_sim import SIZES, ragged_experiment

from pflego.sim import Simulation, metrics

ONE_BY_ONE = {"vmapped_models": "client_by_client", "vmapped_heads": "heads_client_by_client"}
#: The strategy each view gets (vectorized), by algorithm: a shared head (FedAvg), a personal
#: head on the shared body (FedPer), personal models with adapt (Per-FedAvg: before adapt, the
#: downlink's model), a downlink-only prediction (pFedMe's global model).
CHOSEN = {
    "fedavg": {"": "pooled_logits"},
    "fedper": {"": "vmapped_heads"},
    "perfedavg": {"": "vmapped_models", "before_adapt": "pooled_logits"},
    "pfedme": {"": "vmapped_models", "global": "pooled_logits"},
}


def trained(name: str) -> Simulation:
    sim = Simulation(ragged_experiment(name), None)
    sim.run_round(0)
    return sim


def columns(
    sim: Simulation, loop_rows: int, monkeypatch, forced: str | None = None
) -> tuple[dict[str, np.ndarray], metrics.Evaluator]:
    """The evaluation columns after one round (chunks of 3 clients, each one by one when they
    hold ``loop_rows`` samples on average), every view by the strategy ``forced`` if given."""
    monkeypatch.setattr(metrics, "LOOP_ROWS", loop_rows)
    ctx, everyone = sim.context(1), np.arange(len(SIZES))
    states = sim.states(everyone, sim.downlink(ctx, everyone), ctx)
    evaluator = metrics.Evaluator(sim.algorithm, sim.pools, everyone, sim.personalization(1), 3)
    if forced is not None:
        strategy = getattr(metrics.Evaluator, forced)
        evaluator.choices = {view: (strategy, strategy) for view in evaluator.views}
    downlink_for = lambda ids: sim.downlink(ctx, ids, True)  # noqa: E731
    return evaluator.columns(downlink_for, states), evaluator


@pytest.mark.parametrize("name", sorted(CHOSEN))
def test_each_view_gets_its_strategy_once_a_run(name: str, monkeypatch) -> None:
    sim, calls, choose = trained(name), [], metrics.Evaluator.choose
    monkeypatch.setattr(
        metrics.Evaluator, "choose", lambda self, *args: calls.append(1) or choose(self, *args)
    )
    for loop_rows, looped in ((10**9, False), (0, True)):
        calls.clear()
        _, evaluator = columns(sim, loop_rows, monkeypatch)
        assert len(calls) == len(evaluator.views)  # once a run, for its two chunks
        chosen = {view: evaluator.choices[view][looped].__name__ for view in evaluator.views}
        expected = {
            view: ONE_BY_ONE.get(strategy, strategy) if looped else strategy
            for view, strategy in CHOSEN[name].items()
        }
        assert chosen == expected


def test_chunks_run_one_by_one_for_large_clients_on_a_cpu(monkeypatch) -> None:
    monkeypatch.setattr(metrics, "LOOP_ROWS", 64)
    cpu, gpu = torch.device("cpu"), torch.device("cuda")
    assert metrics.one_by_one(cpu, np.array([64, 64, 70]))
    assert not metrics.one_by_one(cpu, np.array([64, 63, 60]))
    assert not metrics.one_by_one(gpu, np.array([1000]))  # a GPU: vmapped


#: Strategies that apply besides the chosen one (float64: the same metrics to 1e-12).
ALTERNATIVES = [
    ("fedavg", 10**9, "vmapped_models"),
    ("fedavg", 0, "client_by_client"),
    ("fedavg", 10**9, "vmapped_heads"),
    ("fedavg", 0, "heads_client_by_client"),
    ("fedper", 10**9, "vmapped_models"),
    ("fedper", 0, "client_by_client"),
    ("fedper", 0, "heads_client_by_client"),
    ("perfedavg", 10**9, "vmapped_models"),
    ("perfedavg", 0, "client_by_client"),
]


@pytest.mark.parametrize(("name", "loop_rows", "strategy"), ALTERNATIVES)
def test_strategies_give_the_same_metrics(
    name: str, loop_rows: int, strategy: str, monkeypatch
) -> None:
    sim = trained(name)
    chosen, _ = columns(sim, 10**9, monkeypatch)
    other, _ = columns(sim, loop_rows, monkeypatch, strategy)
    assert other.keys() == chosen.keys()
    for key, value in chosen.items():
        np.testing.assert_allclose(other[key], value, rtol=0, atol=1e-12, err_msg=key)


def test_an_evaluation_frees_its_features_without_the_cycle_collector(monkeypatch) -> None:
    """The pool's shared features and logits go with the evaluation (no reference cycle keeps
    them to the next garbage collection, past the next evaluation's allocations)."""
    sim = trained("fedper")
    gc.disable()
    try:
        _, evaluator = columns(sim, 10**9, monkeypatch)
        assert evaluator.bodies  # the shared body's features, computed once
        freed = weakref.ref(evaluator)
        del evaluator
        assert freed() is None
    finally:
        gc.enable()
