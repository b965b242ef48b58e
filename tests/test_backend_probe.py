"""``--backend auto`` measures: it picks the fastest candidate of a probe on the first cohort, and
a run's numbers are exactly those of naming that backend."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from conftest import tiny_experiment

from pflego.sim import Simulation, rounds
from pflego.sim.backends import make_backend
from pflego.sim.backends_auto import (
    AutoBackend,
    agreed_choice,
    auto_backend,
    candidates,
    predicted_round,
    slowest_rounds,
    truncated,
    wall_clock,
)


@pytest.fixture(autouse=True)
def probing(monkeypatch) -> None:
    monkeypatch.setenv("PFLEGO_BACKEND_PROBE", "1")  # the suite's conftest switches it off
    monkeypatch.setattr(rounds, "FUSED_MIN_SAMPLES", 10**9)  # the rule is never sure of fused


def fake_timer(seconds: dict[str, tuple[float, float]], calls: list[str]):
    """A timer that runs the work and reports ``seconds[name]`` for one step (twice), then two
    (the second try of each a little slower: the better one counts)."""

    def timer(name, work) -> float:
        work()
        calls.append(name)
        count = calls.count(name) - 1
        return seconds[name][count // 2] + 0.01 * (count % 2)

    return timer


def probed(algorithm: str, seconds: dict[str, tuple[float, float]], **settings) -> Simulation:
    sim = Simulation(tiny_experiment(algorithm=algorithm, **settings), None)
    assert isinstance(sim.backend, AutoBackend) and sim.backend_name == "auto"
    sim.backend.timer = fake_timer(seconds, [])
    return sim


@pytest.mark.parametrize("fastest", ["fused", "vmap"])
def test_auto_picks_the_fastest_of_the_probe(fastest: str) -> None:
    seconds = {name: (1.0, 1.5) for name in ("fused", "vmap")}
    seconds[fastest] = (0.9, 1.3)
    sim = probed("fedavg", seconds)
    sim.run_round(0)
    assert sim.backend_name == fastest
    report = sim.profile_summary()["backend_probe"]
    assert report["chosen"] == fastest and set(report["timings"]) == set(seconds)
    assert report["timings"][fastest]["steps_1"] == 0.9
    assert fastest in sim.backend.summary()


def test_the_loop_wins_where_it_is_faster() -> None:
    """Off CPU the candidates are vmap and the loop; the probe's logic is the same."""
    sim = Simulation(tiny_experiment(algorithm="pfedme"), None)
    auto = AutoBackend(
        ["vmap", "loop"],
        lambda name: make_backend(name, sim.algorithm),
        fake_timer({"vmap": (1.0, 1.4), "loop": (0.5, 0.8)}, []),
    )
    ctx, cohort = sim.context(0), sim.cohort(0)
    downlink = sim.downlink(ctx, cohort)
    auto(
        sim.algorithm, downlink, sim.states(cohort, downlink, ctx), sim.round_inputs(0, cohort), ctx
    )
    assert auto.chosen == "loop"


def test_no_probe_where_every_step_fuses_on_large_clients(monkeypatch) -> None:
    monkeypatch.setattr(rounds, "FUSED_MIN_SAMPLES", 1)
    sim = Simulation(tiny_experiment(algorithm="fedavg"), None)
    assert sim.backend_name == "fused"
    assert sim.profile_summary()["backend_probe"]["not_probed"].startswith("every local step")


def test_prediction_charges_vmap_for_padding_to_the_longest_schedule() -> None:
    sim = Simulation(tiny_experiment(algorithm="fedavg", batch_size=4, local_epochs=1.0), None)
    cohort = sim.round_inputs(0, sim.cohort(0))
    steps = cohort.steps
    assert steps.max() > steps.mean()  # clients of different sizes
    assert predicted_round("vmap", 1.0, 1.5, cohort) == pytest.approx(0.5 + 0.5 * steps.max())
    assert predicted_round("fused", 1.0, 1.5, cohort) == pytest.approx(0.5 + 0.5 * steps.mean())
    short = truncated(cohort, 2, padded=True)
    assert set(short.steps) <= {1, 2} and (short.run[0][0] == cohort.run[0][0][-2:]).all()
    assert short.data.x is cohort.data.x and short.data.batches.shape[1] == 2
    assert candidates(sim.algorithm, torch.device("cuda")) == ["graph", "vmap", "loop"]
    assert candidates(sim.algorithm, torch.device("cpu")) == ["fused", "vmap"]


@pytest.mark.parametrize(("algorithm", "chosen"), [("fedavg", "fused"), ("ditto", "vmap")])
def test_a_probed_run_equals_the_explicit_backend_bit_for_bit(algorithm: str, chosen: str) -> None:
    seconds = {name: (2.0, 3.0) for name in ("fused", "vmap")}
    seconds[chosen] = (1.0, 1.1)
    auto = probed(algorithm, seconds)
    explicit = Simulation(tiny_experiment(algorithm=algorithm, backend=chosen), None)
    for sim in (auto, explicit):
        for t in range(2):
            sim.run_round(t)
    assert auto.backend_name == chosen
    for key, value in explicit.server["params"].items():
        assert torch.equal(auto.server["params"][key], value), key
    for key, value in explicit.store.tensors.items():
        assert torch.equal(auto.store.tensors[key], value), key
    assert auto.evaluate(2) == explicit.evaluate(2)


def test_the_probe_leaves_random_streams_and_inputs_alone() -> None:
    sim = probed("pfedme", {name: (1.0, 2.0) for name in ("fused", "vmap")})
    ctx, cohort = sim.context(0), sim.cohort(0)
    downlink = sim.downlink(ctx, cohort)
    states = sim.states(cohort, downlink, ctx)
    inputs = sim.round_inputs(0, cohort)
    before = {k: v.clone() for k, v in {**downlink, **states}.items()}
    torch.manual_seed(5), np.random.seed(5), random.seed(5)
    generators = torch.get_rng_state(), np.random.get_state()[1].copy(), random.getstate()
    name = sim.backend.probe(sim.algorithm, downlink, states, inputs, ctx)
    assert name == "fused" and not sim.backend.failed  # the tie goes to the first candidate
    assert torch.equal(torch.get_rng_state(), generators[0])
    assert (np.random.get_state()[1] == generators[1]).all() and random.getstate() == generators[2]
    for key, value in {**downlink, **states}.items():
        assert torch.equal(value, before[key]), key


def test_a_resumed_run_keeps_the_probed_backend_without_probing_again() -> None:
    sim = probed("fedavg", {"fused": (2.0, 3.0), "vmap": (1.0, 1.1)})
    sim.run_round(0)
    sim.next_round = 1
    state = sim.state_dict()
    assert state["backend"] == "vmap"
    resumed = Simulation(tiny_experiment(algorithm="fedavg"), None)
    resumed.backend.timer = None  # a probe would call it
    resumed.load_state_dict(state)
    resumed.run_round(1)
    assert resumed.backend_name == "vmap" and resumed.backend.timings == {}
    assert "kept from the checkpoint" in resumed.backend.summary()


def test_without_probing_auto_follows_the_rule(monkeypatch) -> None:
    monkeypatch.setenv("PFLEGO_BACKEND_PROBE", "0")
    sim = Simulation(tiny_experiment(algorithm="fedavg"), None)
    assert not isinstance(sim.backend, AutoBackend) and sim.backend_name == "vmap"
    assert "backend_probe" not in sim.profile_summary()


def predictions(**rounds: float) -> dict[str, dict[str, float]]:
    return {name: {"predicted_round": seconds} for name, seconds in rounds.items()}


def test_processes_agree_on_the_backend_whose_slowest_process_is_fastest() -> None:
    # fused wins on the first process, vmap on the second; vmap's slowest (1.2) beats fused's (2.0)
    measured = [predictions(fused=0.5, vmap=1.0), predictions(fused=2.0, vmap=1.2)]
    assert agreed_choice(slowest_rounds(measured)) == "vmap"
    # a backend that failed on one process is out; none that ran everywhere: no choice
    one_failed = [predictions(fused=0.5, vmap=1.0), predictions(vmap=3.0)]
    assert agreed_choice(slowest_rounds(one_failed)) == "vmap"
    assert agreed_choice(slowest_rounds([predictions(fused=0.5), predictions(vmap=3.0)])) is None


def test_a_process_adopts_the_group_choice_and_waits_while_none_has_trained() -> None:
    built: list[str] = []
    auto = AutoBackend(["fused", "vmap"], lambda name: built.append(name) or name)
    assert not auto.agree([(None, {}, False), (None, {}, False)])  # nobody trained: next round
    auto.fix("fused")  # this process's own probe
    auto.timings = predictions(fused=0.5, vmap=1.0)
    other = ("vmap", predictions(fused=2.0, vmap=1.2), True)
    assert auto.agree([auto.report_for_group, other])
    assert auto.chosen == "vmap" and built == ["fused", "vmap"]
    assert auto.report()["predicted_round_of_the_slowest_process"] == {"fused": 2.0, "vmap": 1.2}
    idle = AutoBackend(["fused", "vmap"], lambda name: name)  # no share of the first cohort
    assert idle.agree([("fused", predictions(fused=0.5, vmap=1.0), True), idle.report_for_group])
    assert idle.chosen == "fused" and "agreed by the processes" in idle.reason
    settled = AutoBackend(["fused", "vmap"], lambda name: name, settled="sure")
    assert settled.agree([("fused", {}, False), ("fused", {}, False)]) and settled.chosen == "fused"


def test_a_backend_that_failed_on_one_process_is_not_agreed_on() -> None:
    auto = AutoBackend(["fused", "vmap"], lambda name: name)
    auto.fix("fused")
    auto.timings = predictions(fused=0.5, vmap=1.0)
    # the other process ran vmap alone (fused failed there): vmap, though fused is faster here
    assert auto.agree([auto.report_for_group, ("vmap", predictions(vmap=3.0), True)])
    assert auto.chosen == "vmap"
    slowest = auto.report()["predicted_round_of_the_slowest_process"]
    assert slowest == {"fused": None, "vmap": 3.0}  # never infinite: profile.json is JSON
    # a process whose every probe failed counts: no backend ran everywhere, the first choice holds
    lone = AutoBackend(["fused", "vmap"], lambda name: name)
    lone.fix("vmap")
    lone.timings = predictions(fused=0.5, vmap=1.0)
    assert lone.agree([lone.report_for_group, ("fused", {}, True)]) and lone.chosen == "vmap"
    assert lone.report()["predicted_round_of_the_slowest_process"] == {"fused": None, "vmap": None}


def test_the_probe_clock_waits_for_the_runs_own_gpu(monkeypatch) -> None:
    """The probe times a backend's kernels on the run's device (cuda:1 of one process too), not
    just their launches: it waits for that device before and after; on a CPU it waits for none."""
    waited: list[object] = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: waited.append(device))
    wall_clock("vmap", lambda: waited.append("work"), device=torch.device("cuda:1"))
    assert waited == [torch.device("cuda:1"), "work", torch.device("cuda:1")]
    waited.clear()
    wall_clock("fused", lambda: waited.append("work"), device=torch.device("cpu"))
    assert waited == ["work"]
    algorithm = tiny_experiment(algorithm="fedavg").algorithm
    backend = auto_backend(algorithm, torch.device("cuda:1"), None, fuses=False)
    assert backend.timer.keywords == {"device": torch.device("cuda:1")}
