"""The fast paths keep the numbers: size buckets, generated populations, a lazily committed store,
evaluation on samples and subsamples (and reuse of unchanged clients), background checkpoints,
profiles, and the conventional baseline's FedAvg being pflego's."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import TINY

import pflego.sim.metrics as evaluation
from pflego import tree
from pflego.algorithms.fedper import FedPer
from pflego.algorithms.perfedavg import PerFedAvg
from pflego.algorithms.pfedme import PFedMe
from pflego.algorithms.pgfed import PGFed
from pflego.cli import main
from pflego.config import load_config
from pflego.data.stream import synthetic_stream
from pflego.errors import ConfigError
from pflego.history import CheckpointWriter, RunDir
from pflego.rng import minibatch_rng
from pflego.sim import Profile, Simulation, build_experiment, resume, run
from pflego.sim.backends import VmapBackend, loop_backend, size_buckets
from pflego.sim.clients import ClientStore, lazy_zeros

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks" / "conventional.py"


def close(a: dict, b: dict, atol: float = 1e-10) -> None:
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], atol=atol, rtol=1e-9, msg=k)


def stream_simulation(**overrides) -> Simulation:
    settings = {
        "dataset": "synthetic-stream",
        "clients": 400,
        "participation": 0.5,
        "inner_steps": 2,
        "client_lr": 0.1,
        "dtype": "float64",
        "algorithm": "fedper",
        "backend": "vmap",
        **overrides,
    }
    return Simulation(build_experiment(load_config(settings)), None)


def test_vmap_over_size_buckets_equals_the_loop():
    sim = stream_simulation()
    ctx, cohort = sim.context(0), sim.cohort(0)
    inputs = sim.round_inputs(0, cohort)
    buckets = size_buckets(inputs.sizes)
    assert len(buckets) > 1 and sorted(np.concatenate(buckets)) == list(range(len(cohort)))
    downlink = sim.downlink(ctx, cohort)
    states = sim.states(cohort, downlink, ctx)
    out_v, st_v = VmapBackend()(sim.algorithm, downlink, states, inputs, ctx)
    out_l, st_l = loop_backend(sim.algorithm, downlink, states, inputs, ctx)
    close(out_v.upload, out_l.upload)
    close(st_v, st_l)
    torch.testing.assert_close(out_v.weight, out_l.weight)


def test_a_generated_population_draws_each_client_from_its_own_seed():
    data = synthetic_stream(1_000_000, seed=3)
    assert data.num_clients == 1_000_000 and data.total_train == int(data.train_counts.sum())
    a = data.clients(np.array([5, 999_999]))
    b = data.clients(np.array([17, 999_999, 5]))
    np.testing.assert_array_equal(a[0][0], b[2][0])  # client 5 whoever is drawn with it
    np.testing.assert_array_equal(a[1][1], b[1][1])
    sim = stream_simulation(clients=1_000_000, participation=1e-4, algorithm="pflego")
    cohort = sim.cohort(0)
    inputs = sim.round_inputs(0, cohort)
    for c, i in enumerate(cohort):
        own = inputs.client(c)
        x, y = data_for(sim, int(i))
        n_train = int(sim.exp.data.train_counts[i])
        torch.testing.assert_close(own.x, torch.from_numpy(x[:n_train]).double())
        classes = np.unique(y[:n_train])  # local labels number the classes it trains on
        np.testing.assert_array_equal(own.y.numpy(), np.searchsorted(classes, y[:n_train]))
        assert own.label_mask.sum() == len(classes)
    test = sim.pools["test"].select(cohort)
    for c, i in enumerate(cohort):  # test samples of other classes: label -1, not "known"
        _, y = data_for(sim, int(i))
        n_train = int(sim.exp.data.train_counts[i])
        seen = np.isin(y[n_train:], y[:n_train])
        assert test.known[c] == seen.sum()
        assert (test.own(c)[1].numpy() == -1).tolist() == (~seen).tolist()
    sim.run_round(0)
    assert int(sim.store.initialized.sum()) == len(cohort)


def data_for(sim: Simulation, client: int) -> tuple[np.ndarray, np.ndarray]:
    counts = sim.exp.data.train_counts + sim.exp.data.test_counts
    return sim.exp.data.draw(client, int(counts[client]))


def test_the_store_takes_memory_only_for_written_rows_and_checkpoints_them():
    big = lazy_zeros((2_000_000, 16), torch.float32)  # 128 MB if committed
    assert big.sum() == 0
    store = ClientStore(2_000_000)
    store.write(np.array([7, 1_999_999]), {"head.weight": torch.ones(2, 4, 8)})
    assert store.nbytes() == 2 * 4 * 8 * 4
    assert store.changed.nonzero().flatten().tolist() == [7, 1_999_999]
    state = store.state_dict()
    assert state["tensors"]["head.weight"].shape == (2, 4, 8)  # the rows written, not 2M
    again = ClientStore(2_000_000)
    again.load_state_dict(state)
    close(again.gather(np.array([7, 8, 1_999_999])), store.gather(np.array([7, 8, 1_999_999])))


def evaluated(sim: Simulation, t: int, monkeypatch) -> tuple[dict, list[int]]:
    """An evaluation's record and the clients it computed (not reused)."""
    seen: list[int] = []
    original = evaluation.evaluate_clients

    def counting(algorithm, downlink_for, states, pools, *args, **kwargs):
        seen.append(len(next(iter(pools.values())).sizes) if kwargs.get("clients") is None else 0)
        return original(algorithm, downlink_for, states, pools, *args, **kwargs)

    monkeypatch.setattr(evaluation, "evaluate_clients", counting)
    record = sim.evaluate(t)
    return record, seen


@dataclass(frozen=True)
class HeadsOnly(FedPer):
    """FedPer whose uploads are zero: the server state never changes (Local's situation)."""

    def client_update(self, downlink, state, data, ctx):
        out, new_state = super().client_update(downlink, state, data, ctx)
        return out._replace(upload=tree.zeros_like(out.upload)), new_state


def test_evaluation_reuses_clients_whose_state_and_server_did_not_change(monkeypatch):
    exp = build_experiment(load_config({**TINY, "algorithm": "fedper"}))
    exp.algorithm = HeadsOnly(model=exp.algorithm.model)
    sim = Simulation(exp, None)
    first, computed = evaluated(sim, 0, monkeypatch)
    assert computed == [TINY["clients"]]
    sim.run_round(0)
    second, computed = evaluated(sim, 1, monkeypatch)
    assert computed == [len(sim.cohort(0))]  # only the clients that trained
    fresh = Simulation(exp, None)
    fresh.store.load_state_dict(sim.store.state_dict())
    fresh.server = sim.server
    third = fresh.evaluate(1)
    for key in ("train_loss", "test_acc", "test_acc_p10"):
        assert second[key] == pytest.approx(third[key], abs=1e-12)
    fedper = Simulation(build_experiment(load_config({**TINY, "algorithm": "fedper"})), None)
    fedper.evaluate(0)
    fedper.run_round(0)
    _, computed = evaluated(fedper, 1, monkeypatch)  # the shared body changed: everyone again
    assert computed == [TINY["clients"]]


def test_evaluation_on_a_client_sample_and_a_training_subsample():
    sim = Simulation(build_experiment(load_config({**TINY, "eval_clients": 4})), None)
    record = sim.evaluate(0)
    assert record["eval_clients"] == 4 and len(sim.eval_ids) == 4
    assert int(sim.store.initialized.sum()) == 4  # nobody else needed a state
    full = Simulation(build_experiment(load_config(TINY)), None)
    full.evaluate(0)
    sample = [full.eval_rows[int(i)] for i in sim.eval_ids]
    assert record["test_acc"] == pytest.approx(np.mean([r["test_acc"] for r in sample]))
    sub = Simulation(build_experiment(load_config({**TINY, "eval_train_samples": 3})), None)
    record = sub.evaluate(0)
    assert record["eval_train_samples"] == 3
    assert sub.eval_pools["train"].sizes.max() == 3
    rows = [sub.eval_rows[i] for i in range(TINY["clients"])]
    assert [r["n_train"] for r in rows] == full.train_pool.sizes.tolist()  # alpha_i = N_i / N
    kept = sub.train_subsample(0, int(full.train_pool.sizes[0]))
    np.testing.assert_array_equal(kept, sub.train_subsample(0, int(full.train_pool.sizes[0])))
    assert record["test_acc"] == pytest.approx(full.records[-1]["test_acc"], abs=1e-12)
    assert record["train_loss"] != pytest.approx(full.records[-1]["train_loss"], abs=1e-9)


def test_a_failed_checkpoint_write_keeps_the_last_one_and_is_reported(tmp_path, monkeypatch):
    run_dir = RunDir(tmp_path)
    writer = CheckpointWriter(run_dir)
    state = {"x": torch.arange(3)}
    writer.submit(state)
    state["x"] += 10  # the run goes on changing its state: the checkpoint has the snapshot
    writer.wait()
    assert torch.equal(torch.load(run_dir.checkpoint)["x"], torch.arange(3))

    def failing(obj, path):
        Path(path).write_bytes(b"half")
        raise OSError("disk full")

    monkeypatch.setattr(torch, "save", failing)
    writer.submit({"x": torch.zeros(3)})
    with pytest.raises(ConfigError, match="cannot write .*checkpoint.pt"):
        writer.wait()
    monkeypatch.undo()
    assert torch.equal(torch.load(run_dir.checkpoint)["x"], torch.arange(3))


def test_runs_checkpoint_in_the_background_and_resume(tmp_path):
    settings = {**TINY, "rounds": 4, "checkpoint_every": 1}
    run(settings, out=tmp_path / "a", progress=False)
    state = RunDir(tmp_path / "a").load_checkpoint()
    assert state["next_round"] == 4
    resumed = resume(tmp_path / "a", progress=False, rounds=5)
    whole = run({**settings, "rounds": 5}, out=tmp_path / "b", progress=False)
    strip = lambda h: [{k: v for k, v in r.items() if k != "seconds"} for r in h.records]  # noqa: E731
    assert strip(resumed) == strip(whole)


def test_run_profile_breaks_the_time_down(tmp_path, capsys):
    out = tmp_path / "run"
    code = main(["run", "--dataset", "tiny", "--rounds", "2", "--quiet", "--profile"]
                + ["--out", str(out), "--set", "eval_every=1"])  # fmt: skip
    assert code == 0
    profile = json.loads((out / "profile.json").read_text())
    parts = profile["seconds"]
    assert {"data", "train", "evaluate", "checkpoint", "other", "total"} <= parts.keys()
    assert parts["train"] > 0 and parts["evaluate"] > 0
    assert parts["total"] >= sum(v for k, v in parts.items() if k != "total") - 1e-2
    assert profile["rounds"] == 2 and profile["evaluations"] == 3
    system = profile["system_seconds"]
    assert 0 <= system["total"] <= profile["cpu_seconds"]["total"] + 0.05
    assert all(system[part] <= profile["cpu_seconds"][part] + 0.05 for part in Profile.PARTS)
    assert "seconds: " in capsys.readouterr().out


def conventional():
    spec = importlib.util.spec_from_file_location("conventional_under_test", BENCHMARKS)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def conventional_beside(sim: Simulation, base, epochs: int, **options):
    """``base``'s runner of ``sim``'s algorithm, from its initial model, on its minibatches."""
    model = sim.algorithm.model
    net = base.split_module(model.body, model.feature_dim, model.num_classes).double()
    net.load_state_dict(tree.select(sim.server["params"], ("body", "head")))

    def orders(t, client):  # pflego's minibatches of (round t, client), epoch by epoch
        n = int(sim.train_pool.sizes[client])
        rng = minibatch_rng(sim.cfg.seed, t, client)
        return [rng.permutation(n) for _ in range(epochs)]

    return base.ConventionalFL(
        sim.cfg.algorithm,
        net,
        [
            base.ClientSplit(s.x_train.double(), s.y_train, s.x_test.double(), s.y_test)
            for s in base.client_splits(sim.exp.data)
        ],
        batch_size=sim.cfg.batch_size,
        epochs=epochs,
        lr=sim.cfg.client_lr,
        options=options,
        sampler_for=orders,
    )


def test_the_conventional_fedavg_is_pflegos_fedavg_on_the_same_batches():
    """The baseline computes the same thing (so the bench compares speeds of equal work)."""
    base = conventional()
    settings = {**TINY, "algorithm": "fedavg", "batch_size": 4, "local_epochs": 2.0}
    sim = Simulation(build_experiment(load_config({**settings, "backend": "fused"})), None)
    runner = conventional_beside(sim, base, epochs=2)
    for t in range(2):
        runner.train_round(t, sim.cohort(t))
        sim.run_round(t)
    close(dict(runner.model.state_dict()), sim.server["params"], atol=1e-9)
    assert runner.evaluate()["test_acc"] == pytest.approx(sim.evaluate(2)["test_acc"])
    # every baseline runs its rounds and evaluates the models pflego reports: pFedMe's global
    # model and Per-FedAvg's before its step too
    views = {"pfedme": "_global", "perfedavg": "_before_adapt"}
    assert PFedMe.downlink_predictions == ("global",) and PerFedAvg.adapts
    for name in base.ALGORITHMS:
        other = base.ConventionalFL(name, runner.model, runner.clients, batch_size=4, lr=0.05)
        other.train_round(0, sim.cohort(0))
        metrics = other.evaluate()
        suffixes = ("", views[name]) if name in views else ("",)
        assert metrics.keys() == {f"{m}{v}" for m in ("test_acc", "train_loss") for v in suffixes}
        assert all(0 <= metrics[f"test_acc{v}"] <= 1 for v in suffixes)


@pytest.mark.parametrize("backend", ["loop", "fused"])
def test_the_conventional_pgfed_is_pflegos_pgfed_on_the_same_batches(backend):
    """Three rounds, so that A's rows, g~_i and the offsets of the previous cohort all matter, with
    a step on A (lam = 1) large enough that the clip at 0 does: the same global and personal
    models, and the same A."""
    base = conventional()
    defaults = {f.name: f.default for f in dataclasses.fields(PGFed)}
    assert base.DEFAULTS["pgfed"] == {k: defaults[k] for k in base.DEFAULTS["pgfed"]}
    options = {**base.DEFAULTS["pgfed"], "lam": 1.0}
    settings = {**TINY, "algorithm": "pgfed", "batch_size": 4, "local_epochs": 1.0}
    config = load_config({**settings, "backend": backend, "options": options})
    sim = Simulation(build_experiment(config), None)
    runner = conventional_beside(sim, base, epochs=1, **options)
    for t in range(3):
        runner.train_round(t, sim.cohort(t))
        sim.run_round(t)
    close(dict(runner.model.state_dict()), sim.server["params"], atol=1e-9)
    coefficients = sim.server["pgfed"]["A"]
    torch.testing.assert_close(runner.alpha_mat, coefficients, atol=1e-12, rtol=1e-9)
    assert (coefficients == 0).any() and (coefficients != coefficients[0, 0]).any()
    for i in sim.cohort(2):  # the personal models theta_i
        local = tree.strip_prefix("local.", sim.store.get(int(i)))
        close(dict(runner.personal[int(i)].state_dict()), local, atol=1e-9)


def test_profile_is_refused_where_it_would_time_nothing(tmp_path, capsys):
    assert main(["run", "--resume", str(tmp_path), "--profile"]) == 2
    assert "remove --profile" in capsys.readouterr().err
    assert main(["run", "--dataset", "tiny", "--seeds", "2", "--profile"]) == 2
    assert "remove --seeds or --profile" in capsys.readouterr().err
