"""The round engine on a fake transport: non-finite updates are dropped and the cohort realized,
nothing is committed when nobody answers or every answer is non-finite, and the sampling the
simulator and Flower share draws the same cohorts over any population."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from conftest import tiny_experiment

from pflego import tree
from pflego.errors import DivergedError
from pflego.sim.engine import Callback, Evaluate, Sampling, run_round, train
from pflego.sim.guards import Updates
from pflego.sim.rounds import Simulation
from pflego.types import Downlink


class FakeTransport:
    """Answers with the simulator's real updates of the cohort, one upload made NaN (``poison``),
    or not at all (``silent``); records what it was asked and what was committed."""

    def __init__(self, sim: Simulation, poison: tuple[int, ...] = (), silent: bool = False):
        self.sim, self.poison, self.silent = sim, poison, silent
        self.calls: list[tuple[str, object]] = []

    def updates(self, t, ctx, cohort):
        self.calls.append(("updates", cohort.tolist()))
        if self.silent:
            return None
        out, states = self.sim.client_updates(t, ctx, cohort)
        upload = {k: v.clone() for k, v in out.upload.items()}
        for c in self.poison:
            for v in upload.values():
                v[c] = float("nan")
        out = out._replace(upload=upload)
        finite = torch.ones(len(cohort), dtype=torch.bool)
        return Updates(cohort, out, states, np.arange(len(cohort)), finite)

    def commit(self, server, clients, states):
        self.calls.append(("commit", clients.tolist()))
        self.server = server


def prepared() -> tuple[Simulation, Sampling]:
    sim = Simulation(tiny_experiment(algorithm="fedavg", participation=0.5), None)
    return sim, sim.sampling


def test_a_non_finite_update_is_dropped_and_the_cohort_realized():
    sim, sampling = prepared()
    cohort = sampling.cohort(0)
    assert len(cohort) == 3
    transport = FakeTransport(sim, poison=(1,))
    done = run_round(0, sampling, transport, sim.server, None)
    assert done.dropped.tolist() == [cohort[1]]
    assert done.kept.tolist() == [cohort[0], cohort[2]]
    assert done.ctx.cohort_size == pytest.approx(sampling.context(0).cohort_size * 2 / 3)
    assert transport.calls == [("updates", cohort.tolist()), ("commit", done.kept.tolist())]
    # The step is the one of the two finite clients alone, with the realized context.
    out, _ = sim.client_updates(0, sampling.context(0), cohort[[0, 2]])
    expected = sim.algorithm.server_round(
        sim.server, out, done.ctx, torch.as_tensor(cohort[[0, 2]])
    )
    for k, v in expected["params"].items():
        torch.testing.assert_close(transport.server["params"][k], v, rtol=0, atol=0)


def test_every_update_non_finite_stops_the_run_and_commits_nothing():
    sim, sampling = prepared()
    transport = FakeTransport(sim, poison=(0, 1, 2))
    with pytest.raises(DivergedError, match="every sampled client's update was non-finite"):
        run_round(0, sampling, transport, sim.server, None)
    assert [name for name, _ in transport.calls] == ["updates"]


def test_a_round_without_answers_commits_nothing():
    sim, sampling = prepared()
    transport = FakeTransport(sim, silent=True)
    done = run_round(0, sampling, transport, sim.server, None)
    assert len(done.kept) == 0 and len(done.dropped) == 0 and len(done.sampled) == 3
    assert [name for name, _ in transport.calls] == ["updates"]


def test_an_empty_cohort_asks_no_transport():
    sim = Simulation(tiny_experiment(sampling="bernoulli", participation=0.01), None)
    transport = FakeTransport(sim)
    done = run_round(0, sim.sampling, transport, sim.server, None)
    assert len(done.sampled) == 0 and transport.calls == []


def test_sampling_depends_only_on_the_population_counts():
    sim, sampling = prepared()

    @dataclasses.dataclass
    class Counts:
        num_clients: int
        total_train: int

    counts = Counts(sim.exp.data.num_clients, sim.exp.data.total_train)
    other = Sampling(sim.cfg, sim.algorithm, counts)
    for t in range(5):
        assert other.context(t) == sampling.context(t)
        assert np.array_equal(other.cohort(t), sampling.cohort(t))
    counts.num_clients += 1  # a late joiner counts from the next draw on
    assert other.context(5).num_clients == counts.num_clients
    assert Sampling(sim.cfg, sim.algorithm, Counts(0, 0)).cohort(0).tolist() == []


def test_the_simulator_commits_through_the_engine():
    sim, _ = prepared()
    before = tree.detach(sim.server["params"])
    sim.run_round(0)
    assert not all(torch.equal(before[k], v) for k, v in sim.server["params"].items())
    assert sim.store.initialized[sim.cohort(0)].all()


class Recorder(Callback):
    def __init__(self, name: str, calls: list) -> None:
        self.name, self.calls = name, calls

    def on_train_begin(self, completed):
        self.calls.append((self.name, "begin", completed))

    def on_round_end(self, completed):
        self.calls.append((self.name, "round", completed))

    def on_evaluation(self, completed, record):
        self.calls.append((self.name, "evaluation", completed, record["round"]))

    def on_train_end(self, completed):
        self.calls.append((self.name, "end", completed))

    def on_train_failed(self, error):
        self.calls.append((self.name, "failed", str(error)))


def test_the_training_loop_calls_its_callbacks_in_order():
    calls: list = []
    due = Evaluate(lambda c: c % 2 == 0, lambda c: {"round": c}, [Recorder("after", calls)])
    callbacks = [Recorder("a", calls), due, Recorder("b", calls)]
    train(1, 3, lambda t: calls.append(("step", t)), callbacks)
    assert calls == [
        ("a", "begin", 1),
        ("b", "begin", 1),
        ("step", 1),
        ("a", "round", 2),
        ("after", "evaluation", 2, 2),
        ("b", "round", 2),
        ("step", 2),
        ("a", "round", 3),
        ("b", "round", 3),
        ("a", "end", 3),
        ("b", "end", 3),
    ]


def test_the_evaluation_due_at_the_start_is_made_when_the_loop_begins_unless_logged():
    for records, rounds in (([], [0, 1, 2]), ([{"round": 0}], [1, 2])):
        calls: list = []
        due = Evaluate(lambda c: True, lambda c: {"round": c}, [Recorder("then", calls)], records)
        train(0, 2, lambda t: None, [due])
        assert [call[2] for call in calls] == rounds


def test_a_loop_that_raises_tells_every_callback_and_goes_on_raising():
    calls: list = []

    def step(t):
        if t == 1:
            raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        train(0, 3, step, [Recorder("a", calls), Recorder("b", calls)])
    assert calls[-3:] == [("b", "round", 1), ("a", "failed", "boom"), ("b", "failed", "boom")]


def test_the_simulator_evaluates_through_its_callbacks():

    sim = Simulation(tiny_experiment(algorithm="fedavg", rounds=3, eval_every=2), None)
    sim.plots = False
    seen: list = []
    evaluate = sim.evaluate
    sim.evaluate = lambda completed: seen.append(completed) or evaluate(completed)
    history = sim.run(progress=False)
    assert seen == [0, 2, 3] and [r["round"] for r in history.records] == [0, 2, 3]


def test_every_callback_of_the_simulator_sees_every_evaluation(monkeypatch):
    import pflego.sim.rounds

    seen: list = []

    class Watched(pflego.sim.rounds.DivergenceCheck):
        def on_evaluation(self, completed, record):
            seen.append(record["round"])
            super().on_evaluation(completed, record)

    monkeypatch.setattr(pflego.sim.rounds, "DivergenceCheck", Watched)
    sim = Simulation(tiny_experiment(algorithm="fedavg", rounds=3, eval_every=2), None)
    history = sim.run(progress=False)
    assert seen == [r["round"] for r in history.records] == [0, 2, 3]


def test_a_downlink_gives_each_client_its_part():
    shared = Downlink({"w": torch.ones(2)})
    assert shared.of(0) is shared.payload and shared.of(5) is shared.payload
    stacked = Downlink({"w": torch.arange(6.0).reshape(3, 2)}, per_client=True)
    assert torch.equal(stacked.of(1)["w"], torch.tensor([2.0, 3.0]))


@pytest.mark.parametrize("algorithm", ["fedavg", "pgfed"])
def test_send_is_shared_or_per_client_as_the_algorithm_declares(algorithm):
    sim = Simulation(tiny_experiment(algorithm=algorithm), None)
    sim.run_round(0)
    ctx, clients = sim.context(1), torch.as_tensor(sim.cohort(1))
    sent = sim.algorithm.send(sim.server, ctx, clients)
    assert sent.per_client == (algorithm == "pgfed")
    if sent.per_client:
        stacked = sim.algorithm.downlink(sim.server, ctx, clients)
        for position in range(len(clients)):
            for k, v in stacked.items():
                assert torch.equal(sent.of(position)[k], v[position])
    else:
        assert sent.of(0) is sim.server["params"]
