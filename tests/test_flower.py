"""Flower adapter, fast tier: everything in process, no daemons.

The Flower path (records, ClientApp, server loop) must give the simulator's numbers for every
registered algorithm, survive node restarts, and keep going when nodes fail.
"""

from __future__ import annotations

import csv
import itertools
import json
import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import torch
from conftest import approx_numbers

pytest.importorskip("flwr", exc_type=ImportError)

from flower_inprocess import InProcessGrid, load_node  # noqa: E402
from flwr.app import RecordDict  # noqa: E402

from pflego import tree  # noqa: E402
from pflego.algorithms import ALGORITHMS, Algorithm  # noqa: E402
from pflego.config import load_config  # noqa: E402
from pflego.flower import records  # noqa: E402
from pflego.flower.apps import STATE_KEY, client_app  # noqa: E402
from pflego.flower.server import FlowerServer  # noqa: E402
from pflego.history import RunDir  # noqa: E402
from pflego.sim import Simulation, build_experiment  # noqa: E402
from pflego.sim.backends import stack_outs  # noqa: E402
from pflego.types import ClientOut, RoundContext  # noqa: E402

SMALL = dict(
    clients=5,
    participation=0.4,
    rounds=2,
    inner_steps=2,
    eval_every=2,
    average_last=0,
    seed=3,
    backend="loop",  # Flower trains one client at a time, as the reference loop does: bit-equal
)


def small_config(algorithm: str, **changes):
    """The small Flower run (with a validation split for algorithms that validate)."""
    if ALGORITHMS[algorithm].uses_validation:
        changes = {"val_fraction": 0.2, **changes}
    return load_config(None, algorithm=algorithm, **{**SMALL, **changes})


def simulate(config, run_dir: RunDir | None = None) -> Simulation:
    """The simulator's round loop for ``config`` (evaluations on the run's schedule)."""
    sim = Simulation(build_experiment(config), run_dir)
    sim.evaluate(0)
    for t in range(config.rounds):
        sim.run_round(t)
        if (t + 1) % config.eval_every == 0 or t + 1 == config.rounds:
            sim.evaluate(t + 1)
    return sim


def without_seconds(records_: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if k != "seconds"} for r in records_]


def read_rows(path: Path) -> list[dict]:
    with path.open(newline="") as f:
        return list(csv.DictReader(f))


# --- records ----------------------------------------------------------------------------------


def test_records_round_trip_is_exact():
    params = {
        "body.w": torch.randn(3, 4),
        "body.b": torch.randn(4, dtype=torch.float64),
        "scalar": torch.tensor(2.5),
    }
    back = records.params_from_record(records.params_to_record(params))
    assert back.keys() == params.keys()
    for k in params:
        assert back[k].dtype == params[k].dtype and torch.equal(back[k], params[k])

    out = ClientOut({"body.w": torch.randn(2, 2)}, torch.tensor(0.125), {"loss": torch.tensor(1.5)})
    again = records.client_out_from_record(records.client_out_to_record(out))
    assert torch.equal(again.upload["body.w"], out.upload["body.w"])
    assert torch.equal(again.weight, out.weight)
    assert torch.equal(again.metrics["loss"], out.metrics["loss"])

    ctx = RoundContext(3, 50, 10.0, 3749, 0.05, 0.1 + 0.2, seed=7)
    assert records.context_from_record(records.context_to_record(ctx)) == ctx

    config = small_config("fedper", options={}, data_dir="/tmp/some 'dir'")
    assert records.decode_config(records.encode_config(config)) == config


# --- the Flower path equals the simulator -----------------------------------------------------


#: Flower's rounds are client-server: algorithms that mix client states peer to peer are refused
#: (tests/test_dfedem.py), and so are those that need public data on the server
#: (tests/test_distillation.py) or calibrate on every client's statistics
#: (tests/test_feature_heads.py).
CLIENT_SERVER = [
    name
    for name in sorted(ALGORITHMS)
    if ALGORITHMS[name].mix is Algorithm.mix
    and not ALGORITHMS[name].public_size
    and ALGORITHMS[name].calibrate is Algorithm.calibrate
]
#: One method of each shape the Flower path must carry, run in the default suite (the others run
#: under ``pytest -m slow``): a shared downlink and no state (fedavg), a personal model beside the
#: global one (ditto), per-client downlinks (fedcac, pfedhn), a fixed shared head (fedbabu),
#: personal heads (pflego, fedper), adaptation at evaluation (perfedavg), a server step and state
#: of its own (scaffold, fedem), an evaluation downlink and population metrics (pgfed, apfl),
#: uploads beside the model (fedgen) and counter-based draws inside local steps (fedsr).
FLOWER_SHAPES = {
    "fedavg", "ditto", "fedcac", "pfedhn", "fedbabu", "pflego", "fedper", "perfedavg",
    "scaffold", "fedem", "pgfed", "apfl", "fedgen", "fedsr",
}  # fmt: skip
#: The simulator's population metrics of a client-server algorithm (tests/test_pgfed_comparators.py).
POPULATION_METRICS = {"apfl": {"alpha_mean", "alpha_min", "alpha_max"}}


@pytest.mark.parametrize(
    "algorithm",
    [a if a in FLOWER_SHAPES else pytest.param(a, marks=pytest.mark.slow) for a in CLIENT_SERVER],
)
def test_flower_path_equals_simulator(algorithm, tmp_path):
    # Each node evaluates its own client: the simulator does the same with chunks of one client,
    # since batched products over stacked parameters (FedEM's components) round by chunk size.
    config = small_config(algorithm, chunk_size=1)
    sim_dir = RunDir(tmp_path / "sim")
    sim_dir.start({}, [])
    sim = simulate(config, sim_dir)
    run_dir = RunDir(tmp_path / "flower")
    run_dir.start({}, [])
    grid = InProcessGrid(client_app, config, tmp_path / "state")
    flower = FlowerServer(config, grid, run_dir, join_timeout=1)
    history = flower.run()

    for key, value in sim.server["params"].items():
        assert torch.equal(flower.server["params"][key], value), key
    # Population metrics (APFL's alpha_mean / _min / _max) are computed from every client's stored
    # state, which only the simulator holds: a Flower server's states live on the nodes.
    population = POPULATION_METRICS.get(algorithm, set())
    assert set(sim.records[0]) - set(history.records[0]) == population
    simulated = [{k: v for k, v in r.items() if k not in population} for r in sim.records]
    assert without_seconds(history.records) == without_seconds(simulated)
    assert read_rows(tmp_path / "flower" / "clients.csv") == read_rows(
        tmp_path / "sim" / "clients.csv"
    )
    assert set(history.records[0]) == set(simulated[0])
    # Private states: what each node keeps equals the simulator's store.
    for context in grid.contexts.values():
        client = int(context.node_config["partition-id"])
        if sim.store.visited[client]:
            kept = records.params_from_record(context.state[STATE_KEY])
            stored = sim.store.get(client)
            assert kept.keys() == stored.keys()
            assert all(torch.equal(kept[k], stored[k]) for k in kept)
        else:
            assert STATE_KEY not in context.state
    assert (tmp_path / "flower" / "curves.png").is_file()


def test_bernoulli_participation_equals_simulator(tmp_path):
    config = small_config("pflego", sampling="bernoulli", participation=0.5)
    sim = simulate(config)
    grid = InProcessGrid(client_app, config, tmp_path / "state")
    flower = FlowerServer(config, grid, None, join_timeout=1)
    history = flower.run()
    for key, value in sim.server["params"].items():
        assert torch.equal(flower.server["params"][key], value), key
    assert without_seconds(history.records) == without_seconds(sim.records)


def test_uniform_count_participation_equals_simulator(tmp_path):
    config = small_config(
        "pflego", sampling="uniform-count", min_cohort=1, max_cohort=4, rounds=3, eval_every=3
    )
    sim = simulate(config)
    assert len({len(sim.cohort(t)) for t in range(3)}) > 1
    grid = InProcessGrid(client_app, config, tmp_path / "state")
    flower = FlowerServer(config, grid, None, join_timeout=1)
    history = flower.run()
    for key, value in sim.server["params"].items():
        assert torch.equal(flower.server["params"][key], value), key
    assert without_seconds(history.records) == without_seconds(sim.records)


def test_state_survives_a_node_restart(tmp_path):
    """A restarted SuperNode has an empty ``context.state``; the state comes back from disk."""
    config = small_config("pflego", participation=0.6)
    sim = simulate(config)
    grid = InProcessGrid(client_app, config, tmp_path / "state")
    flower = FlowerServer(config, grid, None, join_timeout=1)
    flower.start()
    flower.evaluate(0)
    flower.run_round(0)
    for context in grid.contexts.values():  # every node restarts between rounds
        context.state = RecordDict()
    flower.run_round(1)
    record = flower.evaluate(2)
    for key, value in sim.server["params"].items():
        assert torch.equal(flower.server["params"][key], value), key
    assert without_seconds([record]) == without_seconds(sim.records[-1:])
    assert sorted(p.name for p in (tmp_path / "state" / "run-1").iterdir())


# --- faults -----------------------------------------------------------------------------------


def test_failed_and_silent_nodes_do_not_stop_the_run(tmp_path, caplog):
    config = small_config("pflego", participation=0.6, rounds=3, eval_every=1)
    sim = Simulation(build_experiment(config), None)
    cohorts = [sorted(int(c) for c in sim.cohort(t)) for t in range(3)]
    node_of = lambda client: 1000 + client  # noqa: E731  (InProcessGrid's default node ids)
    failing = {"train-0": cohorts[0][0], "train-1": cohorts[1][-1], "evaluate-3": 4}

    def drop(node, message):
        victim = failing.get(message.metadata.group_id)
        if victim is not None and node == node_of(victim):
            return "error" if message.metadata.group_id == "train-0" else "silent"
        return None

    run_dir = RunDir(tmp_path / "run")
    run_dir.start({}, [])
    grid = InProcessGrid(client_app, config, tmp_path / "state", drop=drop)
    server = FlowerServer(config, grid, run_dir, round_timeout=1, join_timeout=1)
    with caplog.at_level("WARNING", logger="pflego.flower"):
        history = server.run()

    assert [r["round"] for r in history.records] == [0, 1, 2, 3]
    events = [
        json.loads(line) for line in (tmp_path / "run" / "flower.jsonl").read_text().splitlines()
    ]
    train = [e for e in events if e["phase"] == "train"]
    assert (
        str(cohorts[0][0]) in train[0]["missing"]
        and "injected failure" in train[0]["missing"][str(cohorts[0][0])]
    )
    assert str(cohorts[1][-1]) in train[1]["missing"]
    assert train[0]["cohort_size"] == pytest.approx(3 * 2 / 3)
    assert train[2]["missing"] == {} and train[2]["cohort_size"] == 3
    assert "4" in events[-1]["missing"]
    assert f"client {cohorts[0][0]}" in caplog.text and "missing" in caplog.text
    # The last evaluation summarizes the clients that answered.
    assert len(read_rows(tmp_path / "run" / "clients.csv")) == 5 * 3 + 4


def test_the_servers_evaluations_pass_through_the_training_loop(tmp_path, monkeypatch):
    import pflego.flower.server
    from pflego.sim.engine import Callback

    seen: list = []

    class Seen(Callback):
        def on_evaluation(self, completed, record):
            seen.append(record["round"])

    class Watched(pflego.flower.server.Evaluate):
        def __init__(self, due, evaluate, then, records):
            super().__init__(due, evaluate, [*then, Seen()], records)

    monkeypatch.setattr(pflego.flower.server, "Evaluate", Watched)
    config = small_config("fedavg", rounds=3, eval_every=2)
    run_dir = RunDir(tmp_path / "run")
    run_dir.start({}, [])
    grid = InProcessGrid(client_app, config, tmp_path / "state")
    history = FlowerServer(config, grid, run_dir, join_timeout=1).run()
    assert seen == [r["round"] for r in history.records] == [0, 2, 3]
    events = [json.loads(line) for line in (tmp_path / "run" / "flower.jsonl").open()]
    assert [(e["round"], e["phase"]) for e in events] == [
        (0, "evaluate"),
        (0, "train"),
        (1, "train"),
        (2, "evaluate"),
        (2, "train"),
        (3, "evaluate"),
    ]
    timed = [sorted(e["phases"]) for e in events if e["phase"] == "train"]
    assert [[p for p in t if p in ("evaluate", "checkpoint")] for t in timed] == [
        ["checkpoint"],
        ["checkpoint", "evaluate"],
        ["checkpoint", "evaluate"],
    ]


def test_a_round_without_answers_leaves_the_server_unchanged(tmp_path):
    config = small_config("fedavg", rounds=1)
    grid = InProcessGrid(
        client_app,
        config,
        tmp_path / "state",
        drop=lambda node, m: "silent" if m.metadata.message_type == "train" else None,
    )
    server = FlowerServer(config, grid, None, round_timeout=1, join_timeout=1)
    server.start()
    before = dict(server.server["params"])
    server.evaluate(0)
    event = server.run_round(0)
    assert event["answered"] == [] and len(event["missing"]) == 2
    assert all(torch.equal(before[k], v) for k, v in server.server["params"].items())


# --- PFLEGO's step stays unbiased when nodes drop out -----------------------------------------


def _pflego_uploads(config):
    """Every client's PFLEGO upload (alpha_i, g_i) at round 0, and the round's context."""
    experiment = build_experiment(config)
    sim = Simulation(experiment, None)
    ctx = sim.context(0)
    downlink = experiment.algorithm.downlink(
        experiment.algorithm.init_server(experiment.algorithm.init_params(config.seed)), ctx
    )
    outs = []
    for i in range(config.clients):
        node = load_node(config, i)
        out, _ = node.train(downlink, node.first_visit_state(downlink, ctx), ctx)
        outs.append(out)
    return experiment.algorithm, ctx, outs


def _expected_step(algorithm, ctx, outs, cohorts, q, correct=True):
    """E[aggregate | at least one answer] over cohorts (with their probabilities) and failures."""
    total, mass = None, 0.0
    for cohort, p_cohort in cohorts:
        for answered in itertools.chain.from_iterable(
            itertools.combinations(cohort, a) for a in range(1, len(cohort) + 1)
        ):
            p = p_cohort * q ** len(answered) * (1 - q) ** (len(cohort) - len(answered))
            real = ctx.realized(len(cohort), len(answered)) if correct else ctx
            step = tree.scale(algorithm.aggregate(stack_outs([outs[i] for i in answered]), real), p)
            total = step if total is None else tree.add(total, step)
            mass += p
    return tree.scale(total, 1.0 / mass)


def test_pflego_step_unbiased_under_random_dropout_fixed_r():
    config = small_config("pflego", participation=0.4)  # I = 5, r = 2
    algorithm, ctx, outs = _pflego_uploads(config)
    exact = tree.weighted_sum(stack_outs(outs).upload, stack_outs(outs).weight)  # sum_i alpha_i g_i
    cohorts = [(c, 1 / 10) for c in itertools.combinations(range(5), 2)]
    q = 0.7
    corrected = _expected_step(algorithm, ctx, outs, cohorts, q)
    for k in exact:
        torch.testing.assert_close(corrected[k], exact[k], rtol=1e-5, atol=1e-7)
    naive = _expected_step(algorithm, ctx, outs, cohorts, q, correct=False)
    ratio = tree.dot(naive, exact) / tree.sq_norm(exact)
    assert float(ratio) < 0.95  # without the correction the step shrinks by about q


def test_pflego_step_given_the_cohort_is_the_simulators_under_bernoulli():
    config = small_config("pflego", sampling="bernoulli", participation=0.5)
    algorithm, ctx, outs = _pflego_uploads(config)
    cohort = (0, 2, 3)
    simulator_step = algorithm.aggregate(stack_outs([outs[i] for i in cohort]), ctx)
    expected = _expected_step(algorithm, ctx, outs, [(cohort, 1.0)], q=0.6)
    for k in simulator_step:
        torch.testing.assert_close(expected[k], simulator_step[k], rtol=1e-5, atol=1e-7)


# --- packaging and CLI ------------------------------------------------------------------------


def test_app_folder_ships_with_the_package():
    from pflego.flower.deploy import app_dir

    spec = tomllib.loads((app_dir() / "pyproject.toml").read_text())
    flwr = spec["tool"]["flwr"]
    assert flwr["app"]["components"] == {
        "serverapp": "pflego.flower.apps:server_app",
        "clientapp": "pflego.flower.apps:client_app",
    }
    assert "federations" not in flwr
    assert {"pflego-config", "out", "round-timeout", "join-timeout", "state-dir"} <= set(
        flwr["app"]["config"]
    )


def test_core_and_simulator_never_import_flwr():
    code = (
        "import sys, pflego, pflego.sim, pflego.cli;"
        "pflego.cli.build_parser();"
        "assert not [m for m in sys.modules if m.split('.')[0] == 'flwr'], 'flwr imported'"
    )
    import pflego

    env = {**os.environ, "PYTHONPATH": str(Path(pflego.__file__).parents[1])}
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120, env=env)


def test_cli_certs_and_argument_checks(tmp_path, capsys):
    from pflego.cli import main

    assert main(["flower", "certs", "--dir", str(tmp_path / "c"), "--nodes", "2"]) == 0
    names = sorted(p.name for p in (tmp_path / "c").iterdir())
    assert names == [
        "ca.crt",
        "node0",
        "node0.pub",
        "node1",
        "node1.pub",
        "server.key",
        "server.pem",
    ]
    assert (tmp_path / "c" / "node0.pub").read_text().startswith("ecdsa-sha2-nistp384 ")
    assert main(["flower", "local", "--nodes", "3", "--clients", "4"]) == 2
    assert "--nodes=3 but --clients=4" in capsys.readouterr().err


# --- validation splits and non-finite updates --------------------------------------------------


def test_validation_split_equals_simulator(tmp_path):
    """Each node evaluates its own client's validation rows (not client 0's)."""
    config = small_config("fedper", val_fraction=0.3)
    sim = simulate(config)
    grid = InProcessGrid(client_app, config, tmp_path / "state")
    history = FlowerServer(config, grid, None, join_timeout=1).run()
    assert "val_acc" in history.records[-1]
    assert without_seconds(history.records) == without_seconds(sim.records)


def test_a_fixed_sample_of_evaluated_clients_equals_simulator(tmp_path):
    """``eval_clients``: only the sampled clients' nodes evaluate, as in the simulator."""
    config = small_config("pflego", eval_clients=3, chunk_size=1)
    sim = simulate(config)
    grid = InProcessGrid(client_app, config, tmp_path / "state")
    history = FlowerServer(config, grid, None, join_timeout=1).run()
    assert history.records[-1]["eval_clients"] == 3
    assert without_seconds(history.records) == without_seconds(sim.records)


def nan_uploads(monkeypatch, bad_clients: set[int]) -> None:
    """FedAvg clients whose data is that of ``bad_clients`` upload NaN (simulator and Flower)."""
    from pflego.algorithms.fedavg import FedAvg

    sizes = build_experiment(small_config("fedavg", partition="dirichlet")).data.train_sizes
    bad_sizes = torch.tensor([float(sizes[c]) for c in bad_clients] or [-1.0])
    assert len(set(sizes.tolist())) == len(sizes)  # sizes tell the clients apart
    original = FedAvg.client_update

    def update(self, downlink, state, data, ctx):
        out, new_state = original(self, downlink, state, data, ctx)
        bad = torch.isin(data.num_samples, bad_sizes.to(data.num_samples.dtype))
        upload = {k: torch.where(bad, torch.nan, v) for k, v in out.upload.items()}
        return out._replace(upload=upload), new_state

    monkeypatch.setattr(FedAvg, "client_update", update)


def test_a_nan_upload_is_dropped_on_flower_as_in_the_simulator(tmp_path, monkeypatch):
    config = small_config(  # float64: padded (simulator) and unpadded (node) sums agree
        "fedavg", partition="dirichlet", participation=0.6, rounds=3, eval_every=1, dtype="float64"
    )
    sim = Simulation(build_experiment(config), None)
    cohorts = [set(int(c) for c in sim.cohort(t)) for t in range(3)]
    bad = min(cohorts[0])
    nan_uploads(monkeypatch, {bad})
    sim = simulate(config)
    run_dir = RunDir(tmp_path / "flower")
    run_dir.start({}, [])
    grid = InProcessGrid(client_app, config, tmp_path / "state")
    flower = FlowerServer(config, grid, run_dir, join_timeout=1)
    history = flower.run()
    expected = [[t, bad] for t in range(3) if bad in cohorts[t]]
    assert sum((r["dropped"] for r in history.records), []) == expected
    assert len(history.records) == len(sim.records) == 4
    for got, want in zip(without_seconds(history.records), without_seconds(sim.records)):
        assert got == approx_numbers(want, 1e-12)  # evaluation sums: padded vs unpadded
    for key, value in sim.server["params"].items():
        assert torch.isfinite(value).all()
        assert torch.equal(flower.server["params"][key], value), key
    # The node kept the client's old state: a dropped update never reaches disk either.
    events = [json.loads(line) for line in (tmp_path / "flower" / "flower.jsonl").open()]
    assert [e["dropped"] for e in events if "dropped" in e] == [[bad]] * len(expected)


def test_the_server_checks_uploads_itself(tmp_path, monkeypatch):
    """A node that calls a NaN upload finite is still dropped by the server."""
    config = small_config("fedavg", partition="dirichlet", participation=1.0, rounds=1)
    nan_uploads(monkeypatch, {1})

    def lying(message, context):
        reply = client_app(message, context)
        if message.metadata.message_type == "train":
            reply.content["pflego"]["finite"] = True
        return reply

    grid = InProcessGrid(lying, config, tmp_path / "state")
    flower = FlowerServer(config, grid, None, join_timeout=1)
    flower.start()
    flower.evaluate(0)
    event = flower.run_round(0)
    assert event["dropped"] == [1] and tree.all_finite(flower.server["params"])


def test_every_update_non_finite_stops_the_flower_run_with_exit_code_3(tmp_path, monkeypatch):
    from pflego.cli.flower_local import divergence
    from pflego.errors import DivergedError

    config = small_config("fedavg", partition="dirichlet", participation=1.0)
    nan_uploads(monkeypatch, set(range(config.clients)))
    run_dir = RunDir(tmp_path / "flower")
    run_dir.start({}, [])
    grid = InProcessGrid(client_app, config, tmp_path / "state")
    with pytest.raises(DivergedError, match="non-finite in round 0") as caught:
        FlowerServer(config, grid, run_dir, join_timeout=1).run()
    assert caught.value.exit_code == 3
    assert divergence(tmp_path / "flower") == str(caught.value)
    assert "\n" not in str(caught.value)


@pytest.mark.parametrize("mode", ["stop", "warn"])
def test_an_exploding_loss_stops_the_flower_run_as_it_stops_the_simulator(tmp_path, mode):
    """The simulator's divergence check runs after each Flower evaluation: the loss of FedAvg at
    client_lr 10 grows ~1000x a round and stays finite (tests/test_divergence.py)."""
    from pflego.cli.flower_local import divergence
    from pflego.errors import DivergedError
    from pflego.sim import run

    settings = dict(dataset="tiny", algorithm="fedavg", clients=6, rounds=2, client_lr=10.0)
    settings |= dict(classes_per_client=2, inner_steps=3, eval_every=1, dtype="float64")
    config = load_config(None, divergence=mode, backend="loop", **settings)
    grid = InProcessGrid(client_app, config, tmp_path / "state")
    flower = FlowerServer(config, grid, RunDir(tmp_path / "flower"), join_timeout=1)
    if mode == "warn":
        flower.run()
        assert [r["round"] for r in flower.records] == [0, 1, 2]
        return
    with pytest.raises(DivergedError, match="the training loss grew from") as caught:
        flower.run()
    with pytest.raises(DivergedError) as simulated:
        run(config, out=tmp_path / "sim", progress=False)
    assert str(caught.value) == str(simulated.value) and caught.value.exit_code == 3
    assert divergence(tmp_path / "flower") == str(caught.value)
    assert [r["round"] for r in flower.records] == [0, 1, 2]
