"""The vectorized simulator: vmap == loop for every algorithm, padding, store, evaluation, device."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import evaluate_pools
from torch.utils.flop_counter import FlopCounterMode

from pflego import tree
from pflego.algorithms import ALGORITHMS
from pflego.config import load_config
from pflego.data import ArrayDataset, register
from pflego.errors import ConfigError
from pflego.rng import seed_for
from pflego.sim import Simulation, build_experiment, metrics, rounds
from pflego.sim.backends import (
    FusedBackend,
    VmapBackend,
    loop_backend,
    make_backend,
    resolve_backend,
)
from pflego.sim.build import split_unseen
from pflego.sim.clients import ClientPool, ClientStore, client_data, schedule, take
from pflego.sim.metrics import evaluate

# Ragged clients: sizes 3..14 (one below the batch size) and 1 to 3 classes each.
SIZES = [5, 9, 14, 3, 8, 11]
CLASSES = [[0, 1], [1, 2, 3], [2], [0, 3], [0, 1, 2], [3, 1]]
VAL_SIZES = [2, 3, 0, 1, 2, 4]  # validation splits, one of them empty


@register("ragged", "mlp", False, "six ragged clients with 1x3x3 inputs (tests only)")
def load_ragged(root: Path, seed: int = 0) -> ArrayDataset:
    rng = np.random.default_rng(5)
    x = rng.normal(size=(400, 1, 3, 3)).astype(np.float32)
    y = rng.integers(0, 4, 400)
    return ArrayDataset("ragged", x, y, None, None, 4)


def ragged_experiment(algorithm: str, **overrides):
    """A float64 experiment whose clients differ in size and label set (``unseen_fraction`` holds
    some of them out, as ``build_experiment`` does)."""
    from pflego.data.federated import from_parts

    settings = {
        "algorithm": algorithm,
        "dataset": "ragged",
        "clients": len(SIZES),
        "participation": 0.5,
        "inner_steps": 3,
        "client_lr": 0.1,
        "dtype": "float64",
        "eval_every": 1,
        "average_last": 0,
        "val_fraction": 0.2,
        **overrides,
    }
    exp = build_experiment(load_config(settings))
    raw = load_ragged(Path("."))
    train, test, val, start = [], [], [], 0
    for size, val_size, classes in zip(SIZES, VAL_SIZES, CLASSES):
        pool = np.flatnonzero(np.isin(raw.y_train, classes))
        train.append(pool[start : start + size])
        test.append(pool[start + size : start + size + 4])
        val.append(pool[start + size + 4 : start + size + 4 + val_size])
        start += size + 4 + val_size
    data = from_parts(raw, train, test, val)
    exp.data, exp.unseen = split_unseen(data, exp.config.unseen_fraction, exp.config.seed)
    model = exp.algorithm.model
    model.max_local_classes = exp.data.max_classes
    return exp


@pytest.mark.parametrize("name", ["fedper", "fedrecon", "fedrep", "local", "pflego"])
def test_ragged_unseen_clients_are_held_out_of_the_ragged_clients(name: str) -> None:
    """``unseen_fraction`` holds out some of the ragged clients themselves: their personal heads
    have the trained clients' width K_max, and they join and are evaluated."""
    exp = ragged_experiment(name, unseen_fraction=0.34)
    assert (exp.data.num_clients, exp.unseen.num_clients) == (4, 2)
    assert exp.unseen.max_classes == exp.data.max_classes == exp.algorithm.model.max_local_classes
    sim = Simulation(exp, None)
    sim.run_round(0)
    record = sim.evaluate(1)
    assert np.isfinite(record["unseen_train_loss"]) and 0 <= record["unseen_test_acc"] <= 1


SETTINGS = {
    "full-batch": {"inner_steps": 3},
    "minibatch": {"batch_size": 4, "local_epochs": 1.0},
    "minibatch-2-epochs-momentum": {
        "batch_size": 4,
        "local_epochs": 2.0,
        "client_optimizer": "momentum",
    },
    # Adam's step count makes a padding step visible unless the optimizer masks it (momentum's
    # leading padding steps are no-ops even unmasked: its buffer starts at zero).
    "minibatch-adam": {"batch_size": 4, "local_epochs": 1.5, "client_optimizer": "adam"},
}


def assert_trees_close(a: dict, b: dict, atol: float = 1e-10) -> None:
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], atol=atol, rtol=1e-9, msg=k)


#: The schedules every method runs in the default suite; the optimizers' (momentum over two
#: epochs, Adam) run under ``pytest -m slow``, 72 methods x 4 settings being half the suite's time.
QUICK_SETTINGS = ("full-batch", "minibatch")


@pytest.mark.parametrize(
    "setting",
    [s if s in QUICK_SETTINGS else pytest.param(s, marks=pytest.mark.slow) for s in SETTINGS],
)
@pytest.mark.parametrize("name", sorted(ALGORITHMS))
def test_vmap_equals_loop(name: str, setting: str) -> None:
    """Every backend gives the loop's uploads, weights, metrics, states and server parameters."""
    optimizer = SETTINGS[setting].get("client_optimizer", "sgd")
    if optimizer != "sgd" and ALGORITHMS[name].client_step != "optimizer":
        pytest.skip(f"{name} refuses client_optimizer={optimizer} (tests/test_ignored_settings.py)")
    sims = {
        b: Simulation(ragged_experiment(name, backend=b, **SETTINGS[setting]), None) for b in BACKS
    }
    assert sims["loop"].backend is loop_backend
    assert isinstance(sims["vmap"].backend, VmapBackend) or not sims["vmap"].algorithm.vmappable
    assert isinstance(sims["fused"].backend, FusedBackend)
    for t in range(3):  # later rounds revisit clients, so stored states are exercised
        results = {}
        for backend, sim in sims.items():
            ctx, cohort = sim.context(t), sim.cohort(t)
            downlink = sim.downlink(ctx, cohort)
            inputs = sim.round_inputs(t, cohort)
            assert len(set(inputs.steps)) > 1 or setting == "full-batch"
            states = sim.states(cohort, downlink, ctx)
            results[backend] = BACKS[backend](sim.algorithm, downlink, states, inputs, ctx)
            sim.run_round(t)
        out_l, st_l = results["loop"]
        for other in ("vmap", "fused"):
            out_o, st_o = results[other]
            assert_trees_close(out_l.upload, out_o.upload)
            assert_trees_close(out_l.metrics, out_o.metrics)
            torch.testing.assert_close(out_l.weight, out_o.weight, atol=1e-12, rtol=0)
            assert_trees_close(st_l, st_o)
    records = {b: sim.evaluate(3) for b, sim in sims.items()}
    for other in ("vmap", "fused"):
        assert_trees_close(sims["loop"].server["params"], sims[other].server["params"])
        assert_trees_close(sims["loop"].store.tensors, sims[other].store.tensors)
        for key in ("train_loss", "test_acc"):
            assert records["loop"][key] == pytest.approx(records[other][key], abs=1e-10)


BACKS = {"loop": loop_backend, "vmap": VmapBackend(), "fused": FusedBackend(threads=2)}


def test_chunked_vmap_equals_unchunked() -> None:
    sim = Simulation(ragged_experiment("pflego", batch_size=4, local_epochs=1.0), None)
    ctx, cohort = sim.context(0), np.arange(len(SIZES))
    downlink = sim.algorithm.downlink(sim.server, ctx)
    states, inputs = sim.states(cohort, downlink, ctx), sim.round_inputs(0, cohort)
    whole = VmapBackend()(sim.algorithm, downlink, states, inputs, ctx)
    chunked = VmapBackend(chunk_size=4)(sim.algorithm, downlink, states, inputs, ctx)
    assert_trees_close(whole[0].upload, chunked[0].upload)
    assert_trees_close(whole[1], chunked[1])


def test_auto_is_default_and_unvmappable_algorithms_never_run_under_vmap(monkeypatch) -> None:
    exp = ragged_experiment("fedavg")
    assert exp.config.backend == "auto"
    assert Simulation(exp, None).backend_name == "vmap"  # clients this small train faster batched
    monkeypatch.setattr(rounds, "FUSED_MIN_SAMPLES", 1)
    assert Simulation(exp, None).backend_name == "fused"  # its SGD steps fuse on CPU
    assert resolve_backend("auto", "cuda", lambda: True) == "graph"  # CUDA graphs there
    assert resolve_backend("loop", "cpu", lambda: True) == "loop"
    momentum = ragged_experiment("fedavg", client_optimizer="momentum")
    assert Simulation(momentum, None).backend_name == "vmap"  # autograd steps: vmap them
    assert isinstance(make_backend("vmap", exp.algorithm), VmapBackend)
    assert isinstance(make_backend("fused", exp.algorithm), FusedBackend)

    class Unvmappable(type(exp.algorithm)):
        vmappable = False

    assert make_backend("vmap", Unvmappable(model=exp.algorithm.model)) is loop_backend
    assert isinstance(make_backend("fused", Unvmappable(model=exp.algorithm.model)), FusedBackend)


@pytest.mark.parametrize("batch_size", [None, 4])
def test_cohort_unpads_to_each_clients_own_data(batch_size: int | None) -> None:
    """Padded cohort rows, cut back to a client's sizes, are exactly its unpadded round inputs."""
    exp = ragged_experiment("fedper", batch_size=batch_size, local_epochs=1.5)
    sim = Simulation(exp, None)
    cohort = np.array([0, 2, 3, 5])
    inputs = sim.round_inputs(7, cohort)
    for c, i in enumerate(cohort):
        rng = np.random.default_rng(seed_for(0, 2, 7, i))
        own = client_data(
            exp.data,
            int(i),
            "local",
            schedule(SIZES[i], 3, batch_size, 1.5, rng),
            torch.float64,
        )
        for field, value in own._asdict().items():
            torch.testing.assert_close(getattr(inputs.client(c), field), value, msg=field)
        # padding steps come first: the last step is real for every client
        assert inputs.data.batch_mask[c, -1].sum() > 0


def _reference_schedule(n, inner_steps, batch_size, local_epochs, rng):
    """The original step-by-step schedule, kept here as the specification."""
    per_epoch = math.ceil(n / batch_size)
    steps = inner_steps if local_epochs is None else max(1, math.ceil(local_epochs * per_epoch))
    idx, mask = np.zeros((steps, batch_size), np.int64), np.zeros((steps, batch_size))
    order = None
    for s in range(steps):
        if s % per_epoch == 0:
            order = rng.permutation(n)
        batch = order[(s % per_epoch) * batch_size : (s % per_epoch + 1) * batch_size]
        idx[s, : len(batch)], mask[s, : len(batch)] = batch, 1.0
    return idx, mask


@pytest.mark.parametrize(
    "n,inner,bs,epochs", [(10, 7, 3, None), (9, 2, 4, 2.5), (12, 5, 4, None), (7, 1, 2, 3.0)]
)
def test_vectorized_schedule_matches_step_by_step(n, inner, bs, epochs) -> None:
    idx, mask = schedule(n, inner, bs, epochs, np.random.default_rng(1))
    ref_idx, ref_mask = _reference_schedule(n, inner, bs, epochs, np.random.default_rng(1))
    np.testing.assert_array_equal(idx.numpy(), ref_idx)
    np.testing.assert_array_equal(mask.numpy(), ref_mask)


def test_store_gathers_and_scatters_only_the_cohort() -> None:
    store = ClientStore(10_000)
    ids = np.array([3, 9_999, 17])
    store.write(ids, {"head.weight": torch.ones(3, 2, 5)})
    assert store.tensors["head.weight"].shape == (10_000, 2, 5)
    assert list(store.missing(np.array([3, 4, 17]))) == [4]
    before = store.tensors["head.weight"].clone()
    store.scatter(np.array([9_999]), {"head.weight": torch.full((1, 2, 5), 7.0)})
    gathered = store.gather(ids)
    assert gathered["head.weight"][1].eq(7).all() and gathered["head.weight"][0].eq(1).all()
    changed = (store.tensors["head.weight"] != before).flatten(1).any(1)
    assert changed.nonzero().flatten().tolist() == [9_999]
    assert store.visited.nonzero().flatten().tolist() == [9_999]


def test_store_reads_every_client_in_place_and_a_few_as_a_copy() -> None:
    store = ClientStore(4)
    store.write(np.arange(4), {"head.weight": torch.arange(8.0).view(4, 2)})
    stored = store.tensors["head.weight"]
    assert store.read(np.arange(4))["head.weight"] is stored
    some = store.read(np.array([2, 0]))["head.weight"]
    assert some.tolist() == [[4.0, 5.0], [0.0, 1.0]]
    assert some.untyped_storage().data_ptr() != stored.untyped_storage().data_ptr()


@pytest.mark.parametrize("name", sorted(ALGORITHMS))
def test_non_sampled_clients_are_unchanged(name: str) -> None:
    sim = Simulation(ragged_experiment(name), None)
    all_clients = np.arange(len(SIZES))
    downlink = sim.downlink(sim.context(0), all_clients)
    before = tree.detach(sim.states(all_clients, downlink, sim.context(0)))
    sim.run_round(0)
    out = np.setdiff1d(all_clients, sim.cohort(0))
    for k, v in before.items():
        torch.testing.assert_close(sim.store.tensors[k][out], v[out], atol=0, rtol=0)


def _eval_reference(algorithm, downlink, state, x, y, lmask):
    """Loss over the samples of classes the client's head has (label >= 0); accuracy over all,
    a class the head lacks (label -1) counting as an error (docs/datasets.md)."""
    logits = algorithm.predict(downlink, state, x)
    logits = torch.where(lmask > 0, logits, torch.finfo(logits.dtype).min)
    known = y >= 0
    loss = torch.nn.functional.cross_entropy(logits[known], y[known])
    return float(loss), float((logits.argmax(-1) == y).double().mean())


@pytest.mark.parametrize("name", sorted(ALGORITHMS))
def test_vectorized_evaluation_matches_per_client(name: str) -> None:
    sim = Simulation(ragged_experiment(name), None)
    sim.run_round(0)
    with sim.calibrated(1):  # the server state evaluation predicts with (CCVR's calibrated)
        ctx = sim.context(1)
        downlink = sim.downlink(ctx, np.arange(len(SIZES)))  # shared, or stacked per client
        states = sim.states(np.arange(len(SIZES)), downlink, ctx)
        downlink_for = lambda ids: sim.downlink(ctx, ids)  # noqa: E731
        _, rows = evaluate_pools(sim.algorithm, downlink_for, states, sim.pools, chunk_size=4)
        data, local = sim.exp.data, sim.algorithm.label_space == "local"
        for i, row in enumerate(rows):
            state = {k: v[i] for k, v in states.items()}
            lmask = sim.train_pool.label_masks[i]
            te = data.test_slice(i)
            y = (data.y_test_local if local else data.y_test)[te]
            own = sim.one_downlink(downlink, i)
            loss, acc = _eval_reference(
                sim.algorithm, own, state, data.inputs(data.x_test[te]).double(), y, lmask
            )
            assert row["test_loss"] == pytest.approx(loss, abs=1e-10)
            assert row["test_acc"] == pytest.approx(acc, abs=1e-12)
        legacy, _ = evaluate(
            sim.algorithm,
            downlink,
            lambda i: sim.client_state(i, downlink, ctx),
            data,
            torch.float64,
            sim.personalization(1),  # the same adapt (if any) as the simulator's evaluation
        )
    assert legacy["train_loss"] == pytest.approx(sim.evaluate(1)["train_loss"], abs=1e-10)


@pytest.mark.parametrize(
    "name", ["ditto", "fedper", "pgfed", "perfedavg", "fedrod", "fedavg+", "knn-per"]
)
def test_evaluation_client_by_client_matches_the_vectorized_one(name: str, monkeypatch) -> None:
    """On a CPU, chunks of large clients are evaluated one client at a time on rows read in
    place (metrics.LOOP_ROWS); the numbers are the vmapped, padded evaluation's."""
    sim = Simulation(ragged_experiment(name), None)
    sim.run_round(0)
    ctx, everyone = sim.context(1), np.arange(len(SIZES))
    downlink = sim.downlink(ctx, everyone)
    states = sim.states(everyone, downlink, ctx)
    columns, calls, looped_metrics = {}, [], metrics.looped_metrics
    monkeypatch.setattr(
        metrics, "looped_metrics", lambda *args: calls.append(1) or looped_metrics(*args)
    )
    few = np.array([5, 1])  # a minority of the samples: the body runs on their rows only
    for loop_rows in (0, 10**9):
        monkeypatch.setattr(metrics, "LOOP_ROWS", loop_rows)
        columns[loop_rows] = metrics.evaluate_clients(
            sim.algorithm, lambda ids: sim.downlink(ctx, ids), states, sim.pools,
            sim.personalization(1), chunk_size=4,
        )  # fmt: skip
        columns[loop_rows, "few"] = metrics.evaluate_clients(
            sim.algorithm, lambda ids: sim.downlink(ctx, ids), tree.map_(lambda v: v[few], states),
            sim.pools, clients=few,
        )  # fmt: skip
    assert calls  # the first evaluation ran client by client
    for looped, vectorized in ((0, 10**9), ((0, "few"), (10**9, "few"))):
        assert columns[looped].keys() == columns[vectorized].keys()
        for key, value in columns[looped].items():
            np.testing.assert_allclose(
                value, columns[vectorized][key], rtol=0, atol=1e-12, err_msg=key
            )


def test_evaluation_personalizes_client_by_client_as_the_run_trains(monkeypatch) -> None:
    """Large clients adapt one by one on their own rows: with fused steps on the ``fused``
    backend (FedAvg+'s fine-tuning), with autograd on ``loop``; the metrics agree."""
    enabled, fused_steps = [], metrics.fused_steps
    monkeypatch.setattr(
        metrics, "fused_steps", lambda on=True: enabled.append(on) or fused_steps(on)
    )
    monkeypatch.setattr(metrics, "LOOP_ROWS", 0)
    records = {}
    for backend in ("fused", "loop"):
        sim = Simulation(ragged_experiment("fedavg+", backend=backend), None)
        sim.run_round(0)
        records[backend] = sim.evaluate(1)
    assert enabled and enabled == [True] * (len(enabled) // 2) + [False] * (len(enabled) // 2)
    assert records["fused"]["test_acc"] == pytest.approx(records["loop"]["test_acc"], abs=1e-12)
    assert records["fused"]["train_loss"] == pytest.approx(records["loop"]["train_loss"], abs=1e-9)
    assert records["fused"]["train_loss"] != records["fused"]["train_loss_before_adapt"]


def test_pflego_client_flops_grow_only_by_head_steps() -> None:
    """Body work is constant in tau; each extra head step costs only K x M x n products."""
    flops = {}
    for tau in (5, 50):
        sim = Simulation(ragged_experiment("pflego", inner_steps=tau), None)
        ctx, cohort = sim.context(0), sim.cohort(0)
        downlink = sim.algorithm.downlink(sim.server, ctx)
        states, inputs = sim.states(cohort, downlink, ctx), sim.round_inputs(0, cohort)
        with FlopCounterMode(display=False) as counter:
            sim.backend(sim.algorithm, downlink, states, inputs, ctx)
        flops[tau] = counter.get_total_flops()
    model, x = sim.algorithm.model, inputs.data.x
    head_step = 2 * 2 * x.shape[0] * x.shape[1] * model.feature_dim * model.max_local_classes
    assert flops[50] - flops[5] <= 45 * head_step
    body_forward = 2 * x.shape[0] * x.shape[1] * 9 * model.feature_dim
    assert flops[5] >= 2 * body_forward  # the features and the joint gradient are counted


def test_cuda_without_gpu_is_a_one_line_config_error() -> None:
    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    with pytest.raises(ConfigError, match="no CUDA GPU"):
        load_config({"device": "cuda"})
    with pytest.raises(ConfigError, match="not one of cpu, cuda"):
        load_config({"device": "tpu"})


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("name", sorted(ALGORITHMS))
def test_cuda_matches_cpu(name: str) -> None:
    sims = {d: Simulation(ragged_experiment(name, device=d), None) for d in ("cpu", "cuda")}
    for sim in sims.values():
        sim.run_round(0)
        sim.run_round(1)
    assert sims["cuda"].train_pool.x.is_cuda
    cuda_params = tree.to(sims["cuda"].server["params"], "cpu")
    assert_trees_close(sims["cpu"].server["params"], cuda_params, atol=1e-8)
    assert sims["cuda"].evaluate(2)["train_loss"] == pytest.approx(
        sims["cpu"].evaluate(2)["train_loss"], abs=1e-8
    )


def test_pool_is_built_once_on_the_device() -> None:
    exp = ragged_experiment("pflego")
    pool = ClientPool.build(exp.data, "train", "local", torch.float64)
    x, y, mask = pool.padded(np.array([3, 2]))
    assert x.shape == (2, 14, 1, 3, 3) and mask.sum(1).tolist() == [3.0, 14.0]
    assert torch.equal(y[0, :3], exp.data.y_train_local[exp.data.train_slice(3)])


@pytest.mark.parametrize(
    "x",
    [
        torch.arange(60.0).reshape(10, 2, 3),  # contiguous rows of several dimensions
        torch.arange(60.0).reshape(10, 6)[:, ::2],  # non-contiguous: advanced indexing kept
        torch.arange(10),  # one dimension
        torch.zeros(0, 3),  # empty
    ],
)
def test_take_is_advanced_indexing(x: torch.Tensor) -> None:
    rows = torch.tensor([[3, 0, 9], [9, 1, 1]]) if len(x) else torch.zeros(2, 0, dtype=torch.long)
    assert torch.equal(take(x, rows), x[rows])
    assert torch.equal(take(x, rows[0]), x[rows[0]])
