"""The contract's extensions: adapt / join, per-client downlinks, the cohort seen by the server,
named schedules, extra predictions, validation metrics, unseen clients, non-finite updates,
interrupt-safe checkpoints."""

from __future__ import annotations

import dataclasses
import json
import signal
from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import pytest
import torch
from conftest import tiny_experiment

from pflego import tree
from pflego.algorithms.fedavg import FedAvg
from pflego.algorithms.fedper import FedPer
from pflego.cli import main
from pflego.errors import DivergedError
from pflego.history import History, RunDir
from pflego.local import train_steps
from pflego.sim import Simulation, resume, run
from pflego.sim.backends import loop_backend
from pflego.types import ClientOut, Schedule


@dataclass(frozen=True)
class FineTunedFedAvg(FedAvg):
    """FedAvg whose evaluation fine-tunes a copy of the global model for two full-batch steps."""

    def adapt(self, downlink, state, data, ctx):
        loss = lambda p, x, y, m: self.loss(p, x, y, m, data.label_mask)  # noqa: E731
        tuned, _, _ = train_steps(loss, downlink, data, self.client_optimizer, {}, ctx.client_lr)
        return {"tuned." + k: v for k, v in tuned.items()}

    def adapt_schedule(self, run):
        return Schedule(2)

    def predict(self, downlink, state, x):
        params = {k[len("tuned.") :]: v for k, v in state.items()} or downlink
        return self.model.forward(params, x)


@dataclass(frozen=True)
class PerClientShift(FedAvg):
    """FedAvg whose downlink adds ``0.01 * client id`` to every parameter (a per-client payload),
    whose server remembers the cohort it saw, and that trains on a named two-step schedule."""

    per_client_downlink: ClassVar[bool] = True
    predictions: ClassVar[tuple[str, ...]] = ("global",)

    def init_server(self, params):
        return {**super().init_server(params), "seen": {"count": torch.zeros(8)}}

    def downlink(self, server, ctx, clients=None):
        if clients is None:
            return server["params"]
        shift = 0.01 * clients.to(next(iter(server["params"].values())).dtype)
        return {
            k: v.unsqueeze(0) + shift.reshape(-1, *[1] * v.dim())
            for k, v in server["params"].items()
        }

    def schedules(self, run):
        return {"extra": Schedule(2)}

    def client_update(self, downlink, state, data, ctx):
        loss = lambda p, x, y, m: self.loss(p, x, y, m, data.label_mask)  # noqa: E731
        trained, _, mean_loss = train_steps(
            loss, downlink, data.using("extra"), self.client_optimizer, {}, ctx.client_lr
        )
        return ClientOut(tree.sub(downlink, trained), data.num_samples, {"loss": mean_loss}), state

    def server_round(self, server, out, ctx, clients):
        server = super().server_round(server, out, ctx, clients)
        count = server["seen"]["count"].index_add(
            0, clients, server["seen"]["count"].new_ones(len(clients))
        )
        return {**server, "seen": {"count": count}}

    def predict_global(self, downlink, state, x):
        return self.model.forward(downlink, x) * 0  # uniform logits: accuracy of a constant guess


def simulation(algorithm_cls=None, **settings) -> Simulation:
    exp = tiny_experiment(**settings)
    if algorithm_cls is not None:
        fields = {f.name: getattr(exp.algorithm, f.name) for f in dataclasses.fields(FedAvg)}
        exp.algorithm = algorithm_cls(**fields)
    return Simulation(exp, None)


def test_adapt_runs_before_evaluation_and_is_never_stored():
    sim = simulation(FineTunedFedAvg, algorithm="fedavg")
    sim.run_round(0)
    before = {k: v.clone() for k, v in sim.store.tensors.items()}
    record = sim.evaluate(1)
    assert record["adapted"] is True
    assert sim.store.tensors.keys() == before.keys()
    for k, v in before.items():
        assert torch.equal(sim.store.tensors[k], v)
    # Before adapt is FedAvg's own global model; fine-tuning on the training split fits it better.
    assert record["train_loss"] < record["train_loss_before_adapt"]
    plain = simulation(algorithm="fedavg")
    plain.run_round(0)
    assert plain.evaluate(1)["test_acc"] == pytest.approx(record["test_acc_before_adapt"])


def test_vectorized_adapt_equals_adapting_each_client_alone():
    sim = simulation(FineTunedFedAvg, algorithm="fedavg", chunk_size=4)
    sim.run_round(0)
    _, rows = sim_rows(sim, 1)
    algorithm, ctx = sim.algorithm, sim.context(1)
    downlink = algorithm.downlink(sim.server, ctx)
    personal = sim.personalization(1)
    for i, row in enumerate(rows):
        data = personal.inputs(np.array([i]))
        one = tree_index(data, 0)
        tuned = algorithm.adapt(downlink, {}, one, ctx)
        pool = sim.test_pool
        x, y, mask = pool.padded(np.array([i]))
        logits = algorithm.predict(downlink, tuned, x[0][mask[0] > 0])
        acc = float((logits.argmax(-1) == y[0][mask[0] > 0]).double().mean())
        assert row["test_acc"] == pytest.approx(acc, abs=1e-12)


def sim_rows(sim: Simulation, completed: int):
    from conftest import evaluate_pools

    ctx = sim.context(completed)
    return evaluate_pools(
        sim.algorithm,
        sim.algorithm.downlink(sim.server, ctx),
        sim.store.tensors,
        sim.pools,
        sim.personalization(completed),
        sim.cfg.chunk_size,
    )


def tree_index(data, c: int):
    return torch.utils._pytree.tree_map(lambda t: t[c], data)


def test_per_client_downlinks_named_schedules_and_the_cohort_reach_the_algorithm():
    sims = {b: simulation(PerClientShift, algorithm="fedavg", backend=b) for b in ("vmap", "loop")}
    for sim in sims.values():
        for t in range(2):
            sim.run_round(t)
    for k, v in sims["vmap"].server["params"].items():
        torch.testing.assert_close(sims["loop"].server["params"][k], v, rtol=1e-9, atol=1e-12)
    counts = sims["vmap"].server["seen"]["count"]
    expected = torch.zeros_like(counts)
    for t in range(2):
        expected[torch.as_tensor(sims["vmap"].cohort(t))] += 1
    assert torch.equal(counts, expected)
    # The client saw its own shifted payload and ran the two steps of its named schedule.
    sim = simulation(PerClientShift, algorithm="fedavg")
    ctx, cohort = sim.context(0), sim.cohort(0)
    inputs = sim.round_inputs(0, cohort)
    assert inputs.data.schedules["extra"][0].shape[:2] == (len(cohort), 2)
    downlink = sim.downlink(ctx, cohort)
    out, _ = loop_backend(sim.algorithm, downlink, {}, inputs, ctx)
    c = 1
    one = {k: v[c] for k, v in downlink.items()}
    ref = FedAvg.client_update(  # the same two steps by hand: FedAvg on the named schedule
        sim.algorithm, one, {}, inputs.client(c).using("extra")._replace(schedules={}), ctx
    )[0]
    for k in ref.upload:
        torch.testing.assert_close(out.upload[k][c], ref.upload[k])


def test_extra_predictions_and_validation_metrics_are_reported():
    sim = simulation(PerClientShift, algorithm="fedavg", val_fraction=0.2)
    sim.run_round(0)
    record = sim.evaluate(1)
    assert {"val_acc", "val_loss", "test_acc_global", "train_loss_global"} <= record.keys()
    assert 0 <= record["val_acc"] <= 1
    # Uniform logits predict class 0 for every sample: its accuracy is the share of that class.
    assert record["test_acc_global"] < record["test_acc"] or record["test_acc"] < 0.5


def test_unseen_clients_never_train_and_are_reported_apart():
    sim = simulation(algorithm="fedper", unseen_fraction=0.34, participation=1.0)
    assert sim.exp.data.num_clients == 4 and sim.exp.unseen.num_clients == 2
    assert sim.context(0).num_clients == 4
    assert sim.context(0).total_samples == sim.exp.data.total_train
    sim.run_round(0)
    record = sim.evaluate(1)
    assert {"unseen_test_acc", "unseen_train_loss", "test_acc"} <= record.keys()
    assert sim.store.num_clients == 4


def test_unseen_join_personalizes_from_the_trained_body():
    @dataclass(frozen=True)
    class JoiningFedPer(FedPer):
        def join(self, downlink, state, data, ctx):
            return {k: torch.zeros_like(v) for k, v in state.items()}  # a visible change

    sim = simulation(JoiningFedPer, algorithm="fedper", unseen_fraction=0.34)
    sim.run_round(0)
    record = sim.evaluate(1)
    # Zero heads give uniform logits, so the unseen loss is exactly log K_i per sample.
    ks = (sim.exp.unseen.client_classes >= 0).sum(1).double()
    n = sim.exp.unseen.train_sizes.double()
    expected = float((n * ks.log()).sum() / n.sum())
    assert record["unseen_train_loss"] == pytest.approx(expected, rel=1e-9)


@dataclass(frozen=True)
class NaNClient(FedAvg):
    """FedAvg whose clients with ``bad_size`` samples upload NaN."""

    def client_update(self, downlink, state, data, ctx):
        out, new_state = super().client_update(downlink, state, data, ctx)
        bad = data.num_samples == self.bad_size
        upload = {k: torch.where(bad, torch.nan, v) for k, v in out.upload.items()}
        return out._replace(upload=upload), new_state

    bad_size: float = -1.0


def test_a_non_finite_update_is_dropped_and_logged(tmp_path):
    exp_sim = simulation(algorithm="fedavg", participation=1.0)
    sizes = exp_sim.exp.data.train_sizes
    bad = sizes == sizes.min()
    assert 0 < int(bad.sum()) < len(sizes)
    exp = exp_sim.exp
    fields = {f.name: getattr(exp.algorithm, f.name) for f in dataclasses.fields(FedAvg)}
    exp.algorithm = NaNClient(**fields, bad_size=float(sizes.min()))
    run_dir = RunDir(tmp_path / "run")
    run_dir.start({}, [])
    sim = Simulation(exp, run_dir)
    sim.run_round(0)
    assert all(bool(torch.isfinite(v).all()) for v in sim.server["params"].values())
    record = sim.evaluate(1)
    assert record["dropped"] == [[0, int(i)] for i in torch.nonzero(bad).flatten()]
    # The aggregate is the weighted mean of the other clients' updates.
    ref = simulation(algorithm="fedavg", participation=1.0)
    ctx, cohort = ref.context(0), ref.cohort(0)
    downlink = ref.downlink(ctx, cohort)
    out, _ = ref.backend(ref.algorithm, downlink, {}, ref.round_inputs(0, cohort), ctx)
    keep = ~bad
    step = tree.weighted_sum(
        {k: v[keep] for k, v in out.upload.items()}, out.weight[keep] / out.weight[keep].sum()
    )
    for k, v in downlink.items():
        torch.testing.assert_close(sim.server["params"][k], v - step[k])
    json.loads(run_dir.metrics.read_text().splitlines()[-1])


def test_divergence_stops_with_exit_code_3_and_valid_logs(tmp_path, capsys):
    out = tmp_path / "run"
    code = main(
        [
            "run",
            "--dataset",
            "tiny",
            "--clients",
            "6",
            "--rounds",
            "3",
            "--client-lr",
            "1e30",
            "--server-lr",
            "1e30",
            "--classes-per-client",
            "2",
            "--out",
            str(out),
            "--quiet",
            "--set",
            "inner_steps=3",
            "--set",
            "checkpoint_every=1",
        ]  # fmt: skip
    )
    err = capsys.readouterr().err
    assert code == 3
    assert err.count("\n") == 1 and "non-finite" in err and "round" in err
    for line in (out / "metrics.jsonl").read_text().splitlines():
        json.loads(line)  # strict JSON: NaN would not parse as a number here
    assert (out / "checkpoint.pt").is_file()


def test_divergence_is_an_error_in_the_api():
    sim = simulation(algorithm="fedavg", client_lr=1e30, server_lr=1e30)
    with pytest.raises(DivergedError):
        for t in range(3):
            sim.run_round(t)


def test_interrupt_checkpoints_and_resume_extends_the_run(tmp_path, tiny_settings):
    out = tmp_path / "run"
    settings = {**tiny_settings, "rounds": 4, "checkpoint_every": 100}
    calls = {"n": 0}
    original = Simulation.run_round

    def interrupting(self, t):
        calls["n"] += 1
        if calls["n"] == 2:
            signal.raise_signal(signal.SIGINT)  # Ctrl-C in the middle of round 1
        return original(self, t)

    Simulation.run_round = interrupting
    try:
        with pytest.raises(KeyboardInterrupt):
            run(settings, out=out, progress=False)
    finally:
        Simulation.run_round = original
    resumed = resume(out, progress=False, rounds=6)
    whole = run({**settings, "rounds": 6}, out=tmp_path / "whole", progress=False)
    strip = lambda h: [{k: v for k, v in r.items() if k != "seconds"} for r in h.records]  # noqa: E731
    assert strip(resumed) == strip(whole)
    assert strip(History.load(out)) == strip(whole)


@pytest.mark.parametrize("name", ["pfedme", "fedrod"])
def test_a_downlink_only_view_is_evaluated_once_per_split_with_the_same_numbers(name, monkeypatch):
    """``downlink_predictions``: the view's logits come from one pass over each split (its
    ``predict_v`` called with no state) and equal the per-client evaluation of the same view."""
    from test_fast_sim import ragged_experiment

    sims = [Simulation(ragged_experiment(name, participation=0.5), None) for _ in range(2)]
    for sim in sims:
        sim.run_round(0)
    algorithm = type(sims[0].algorithm)
    (view,) = algorithm.downlink_predictions
    predict = getattr(algorithm, f"predict_{view}")
    states_seen = []

    def recording(self, downlink, state, x):
        states_seen.append(state)
        return predict(self, downlink, state, x)

    monkeypatch.setattr(algorithm, f"predict_{view}", recording)
    once = sims[0].evaluate(1)
    assert states_seen and all(state is None for state in states_seen)
    monkeypatch.setattr(algorithm, "downlink_predictions", ())
    per_client = sims[1].evaluate(1)
    assert any(state is not None for state in states_seen)
    keys = [k for k in once if k.endswith(f"_{view}")]
    assert keys and once.keys() == per_client.keys()
    for key in keys + [k for k in once if k.startswith(("test_", "train_"))]:
        assert once[key] == pytest.approx(per_client[key], rel=1e-12, abs=1e-12), key
