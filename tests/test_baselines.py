"""The PFLEGO paper's baselines: each defining update against a hand-written float64 reference.

The references below use only torch autograd on the MLP written out by hand (no library training
loop, tree algebra or optimizer) and run client by client on the ragged clients of
``test_fast_sim`` (sizes 3..14, one to three classes each); the library runs the real round loop
(vmap backend) and the two must agree to rounding.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from conftest import evaluate_pools, tiny_experiment
from test_fast_sim import ragged_experiment

from pflego.sim import Simulation

BODY = ("body.1.weight", "body.1.bias")
HEAD = ("head.weight", "head.bias")
LR = 0.1  # ragged_experiment's client_lr


def logits(p: dict, x: torch.Tensor) -> torch.Tensor:
    """Flatten -> Linear -> ReLU -> linear head, written out."""
    h = torch.relu(x.flatten(1) @ p["body.1.weight"].T + p["body.1.bias"])
    return h @ p["head.weight"].T + p["head.bias"]


def cross_entropy(k: int):
    """Mean cross-entropy over the first k logits (a client's own classes, or all C)."""
    return lambda p, x, y: F.cross_entropy(logits(p, x)[:, :k], y)


def proximal(loss, strength: float, anchor: dict):
    """``loss + strength / 2 * ||p - anchor||^2`` over the anchor's entries."""
    return lambda p, x, y: (
        loss(p, x, y) + strength / 2 * sum(((p[k] - a) ** 2).sum() for k, a in anchor.items())
    )


def descend(params: dict, trainable, loss, steps, lr: float = LR) -> dict:
    """Gradient steps on ``trainable`` entries, one per (x, y) batch; empty batches do nothing."""
    p = {k: v.detach().clone() for k, v in params.items()}
    for x, y in steps:
        if len(y) == 0:
            continue
        leaves = {k: p[k].clone().requires_grad_(True) for k in trainable}
        grads = torch.autograd.grad(loss({**p, **leaves}, x, y), list(leaves.values()))
        for (k, v), g in zip(leaves.items(), grads, strict=True):
            p[k] = (v - lr * g).detach()
    return p


def steps_of(data, schedule: str | None = None, parity: int | None = None):
    """The (x, y) of every step of one client's unpadded schedule (the run's, or a named one)."""
    idx, mask = (data.batches, data.batch_mask) if schedule is None else data.schedules[schedule]
    out = []
    for row, m in zip(idx, mask, strict=True):
        keep = m > 0
        if parity is not None:
            keep &= row % 2 == parity
        out.append((data.x[row[keep]], data.y[row[keep]]))
    return out


def classes(data) -> int:
    return int(data.label_mask.sum())


def round_inputs(sim: Simulation, t: int):
    """Round t's context, cohort, downlink, the cohort's states and each client's data."""
    ctx, cohort = sim.context(t), sim.cohort(t)
    downlink = sim.algorithm.downlink(sim.server, ctx)
    states = sim.states(cohort, downlink, ctx)
    inputs = sim.round_inputs(t, cohort)
    clients = [inputs.client(c) for c in range(len(cohort))]
    return cohort, {k: v.clone() for k, v in downlink.items()}, states, clients


def averaged(start: dict, trained: list[dict], clients) -> dict:
    """The server's step: ``start - sum_i (N_i / N_S) (start - trained_i)`` on start's entries."""
    sizes = torch.stack([d.num_samples for d in clients])
    weights = sizes / sizes.sum()
    return {
        k: v - sum(w * (v - t[k]) for w, t in zip(weights, trained, strict=True))
        for k, v in start.items()
    }


def assert_close(actual: dict, expected: dict) -> None:
    assert actual.keys() == expected.keys()
    for k in expected:
        torch.testing.assert_close(actual[k], expected[k], rtol=1e-9, atol=1e-11, msg=k)


def row_of(rows: list[dict], client: int) -> dict:
    return next(r for r in rows if r["client"] == client)


def evaluation_rows(sim: Simulation, completed: int):
    ctx = sim.context(completed)
    downlink = sim.algorithm.downlink(sim.server, ctx)
    sim.initialize(np.arange(sim.exp.data.num_clients), downlink, ctx)
    _, rows = evaluate_pools(
        sim.algorithm,
        downlink,
        sim.store.tensors,
        sim.pools,
        sim.personalization(completed),
    )
    return downlink, rows


def split(sim: Simulation, i: int, name: str):
    """Client i's whole training or test split (inputs, labels in the algorithm's label space)."""
    data = sim.exp.data
    sl = data.train_slice(i) if name == "train" else data.test_slice(i)
    local = sim.algorithm.label_space == "local"
    y = getattr(data, f"y_{name}_local" if local else f"y_{name}")[sl]
    return data.inputs(getattr(data, f"x_{name}")[sl]).double(), y


def assert_row_matches(sim: Simulation, row: dict, params: dict, k: int) -> None:
    """The evaluation row of a client is that of ``params`` on its test split."""
    x, y = split(sim, row["client"], "test")
    out = logits(params, x)[:, :k]
    known = y >= 0  # test samples of classes the client never trained on: errors, not in the loss
    loss = F.cross_entropy(out[known], y[known])
    assert row["test_loss"] == pytest.approx(float(loss), abs=1e-10)
    assert row["test_acc"] == pytest.approx(float((out.argmax(1) == y).double().mean()), abs=1e-12)


# --- FedRep -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "settings",
    [
        {"options": {"head_steps": 2, "body_steps": 3}},
        {"batch_size": 4, "options": {"head_epochs": 2.0, "body_epochs": 1.0}},
    ],
    ids=["steps-full-batch", "epochs-minibatch"],
)
def test_fedrep_trains_the_head_then_the_body_and_averages_the_bodies(settings):
    sim = Simulation(ragged_experiment("fedrep", participation=0.5, **settings), None)
    heads: dict[int, dict] = {}
    for t in range(3):  # later rounds revisit clients: their kept heads are the starting points
        cohort, downlink, states, clients = round_inputs(sim, t)
        trained = []
        for c, (i, data) in enumerate(zip(cohort, clients, strict=True)):
            head = heads.get(int(i), {k: states[k][c] for k in HEAD})
            loss = cross_entropy(classes(data))
            after_head = descend({**downlink, **head}, HEAD, loss, steps_of(data, "head"))
            after_body = descend(after_head, BODY, loss, steps_of(data, "body"))
            heads[int(i)] = {k: after_body[k] for k in HEAD}
            trained.append(after_body)
        if "head_steps" in settings["options"]:
            assert [len(d.schedules["head"][0]) for d in clients] == [2] * len(cohort)
            assert [len(d.schedules["body"][0]) for d in clients] == [3] * len(cohort)
        sim.run_round(t)
        assert_close(sim.server["params"], averaged(downlink, trained, clients))
        for i in cohort:
            assert_close(sim.store.get(int(i)), heads[int(i)])


# --- FedBABU ----------------------------------------------------------------------------------


@pytest.mark.parametrize("finetune", ["whole", "head"])
def test_fedbabu_keeps_its_head_fixed_and_fine_tunes_only_at_evaluation(finetune):
    options = {"finetune": finetune, "finetune_epochs": 2.0}
    sim = Simulation(ragged_experiment("fedbabu", participation=0.5, options=options), None)
    head = {k: v.clone() for k, v in sim.server["head"].items()}
    weight = head["head.weight"]
    torch.testing.assert_close(weight @ weight.T, torch.eye(4, dtype=weight.dtype))
    assert torch.equal(head["head.bias"], torch.zeros(4, dtype=weight.dtype))
    for t in range(3):
        cohort, downlink, _, clients = round_inputs(sim, t)
        body = {k: downlink[k] for k in BODY}
        trained = [descend(downlink, BODY, cross_entropy(classes(d)), steps_of(d)) for d in clients]
        sim.run_round(t)
        assert_close(sim.server["params"], averaged(body, trained, clients))
        for k, v in head.items():  # bit for bit, in the server and in what it sends
            assert torch.equal(sim.server["head"][k], v)
            assert torch.equal(sim.algorithm.downlink(sim.server, sim.context(t))[k], v)
        assert sim.store.tensors == {}  # nothing personal is kept while training
    downlink, rows = evaluation_rows(sim, 3)
    assert sim.store.tensors == {}  # the fine-tuned copies are not kept either
    tunable = BODY + HEAD if finetune == "whole" else HEAD
    for i in range(sim.exp.data.num_clients):
        x, y = split(sim, i, "train")
        tuned = descend(downlink, tunable, cross_entropy(4), [(x, y)] * 2)  # 2 full-batch epochs
        assert_row_matches(sim, row_of(rows, i), tuned, 4)
        row = row_of(rows, i)
        before = {"client": i, **{k: row[f"{k}_before_adapt"] for k in ("test_loss", "test_acc")}}
        assert_row_matches(sim, before, downlink, 4)  # the global model


# --- FedRecon ---------------------------------------------------------------------------------


@pytest.mark.parametrize("keep_head", [False, True])
@pytest.mark.parametrize("split_dataset", [False, True])
def test_fedrecon_reconstructs_the_head_each_visit_then_trains_the_body(keep_head, split_dataset):
    options = {
        "keep_head": keep_head,
        "split_dataset": split_dataset,
        "recon_steps": 3,
        "body_steps": 2,
    }
    sim = Simulation(ragged_experiment("fedrecon", participation=1.0, options=options), None)
    w0 = {k: v.clone() for k, v in sim.server["head"].items()}
    kept: dict[int, dict] = {}
    recon_parity, body_parity = (0, 1) if split_dataset else (None, None)
    for t in range(2):  # every client is visited twice
        cohort, downlink, states, clients = round_inputs(sim, t)
        body = {k: downlink[k] for k in BODY}
        trained = []
        for c, (i, data) in enumerate(zip(cohort, clients, strict=True)):
            first = {k: states[k][c] for k in HEAD} if keep_head else w0
            start = kept.get(int(i), first) if keep_head else w0
            loss = cross_entropy(classes(data))
            recon = descend({**body, **start}, HEAD, loss, steps_of(data, "recon", recon_parity))
            after = descend(recon, BODY, loss, steps_of(data, "body", body_parity))
            kept[int(i)] = {k: recon[k] for k in HEAD}
            trained.append(after)
        sim.run_round(t)
        assert_close(sim.server["params"], averaged(body, trained, clients))
        if keep_head:
            for i in cohort:
                assert_close(sim.store.get(int(i)), kept[int(i)])
        else:
            assert sim.store.tensors == {}  # the reconstructed heads are dropped
        for k, v in w0.items():
            assert torch.equal(sim.server["head"][k], v)
    downlink, rows = evaluation_rows(sim, 2)
    for i in range(sim.exp.data.num_clients):
        k = int((sim.exp.data.client_classes[i] >= 0).sum())
        if keep_head:  # evaluation uses the kept head
            head = kept[i]
        else:  # evaluation reconstructs from W0 on the whole training split
            head = descend({**downlink}, HEAD, cross_entropy(k), [split(sim, i, "train")] * 3)
        assert_row_matches(sim, row_of(rows, i), {**downlink, **head}, k)


# --- FedProx ----------------------------------------------------------------------------------


@pytest.mark.parametrize("settings", [{}, {"batch_size": 4, "local_epochs": 1.5}])
def test_fedprox_with_mu_zero_is_fedavg_exactly(settings):
    sims = {
        name: Simulation(ragged_experiment(name, options=options, **settings), None)
        for name, options in (("fedavg", {}), ("fedprox", {"mu": 0.0}))
    }
    for t in range(3):
        outs = {}
        for name, sim in sims.items():
            cohort, downlink, states, _ = round_inputs(sim, t)
            outs[name] = sim.backend(
                sim.algorithm, downlink, states, sim.round_inputs(t, cohort), sim.context(t)
            )[0]
            sim.run_round(t)
        for k, v in outs["fedavg"].upload.items():
            assert torch.equal(outs["fedprox"].upload[k], v)
        assert torch.equal(outs["fedprox"].metrics["loss"], outs["fedavg"].metrics["loss"])
    for k, v in sims["fedavg"].server["params"].items():
        assert torch.equal(sims["fedprox"].server["params"][k], v)


def test_fedprox_local_steps_descend_the_proximal_objective():
    mu = 0.8
    sim = Simulation(ragged_experiment("fedprox", options={"mu": mu}), None)
    plain = Simulation(ragged_experiment("fedavg"), None)
    for t in range(2):
        cohort, downlink, _, clients = round_inputs(sim, t)
        trained = [
            descend(downlink, BODY + HEAD, proximal(cross_entropy(4), mu, downlink), steps_of(d))
            for d in clients
        ]
        sim.run_round(t)
        plain.run_round(t)
        assert_close(sim.server["params"], averaged(downlink, trained, clients))
    gap = (sim.server["params"]["body.1.weight"] - plain.server["params"]["body.1.weight"]).abs()
    assert gap.max() > 1e-6  # the proximal term changes the steps after the first


def test_fedprox_logs_its_clients_data_loss_without_the_proximal_term():
    """The client's logged loss is F_k's at each step's start, averaged over its steps, as
    FedAvg's: the proximal term steers the steps but its value is not logged."""
    mu = 0.8
    sim = Simulation(ragged_experiment("fedprox", options={"mu": mu}), None)
    cohort, downlink, states, clients = round_inputs(sim, 0)
    out = sim.backend(sim.algorithm, downlink, states, sim.round_inputs(0, cohort), sim.context(0))
    for c, data in enumerate(clients):
        p, losses = downlink, []
        for x, y in steps_of(data):
            if len(y) > 0:
                losses.append(float(cross_entropy(4)(p, x, y)))
                p = descend(p, BODY + HEAD, proximal(cross_entropy(4), mu, downlink), [(x, y)])
        assert float(out[0].metrics["loss"][c]) == pytest.approx(sum(losses) / len(losses))


# --- Ditto ------------------------------------------------------------------------------------


def test_ditto_personal_models_are_pulled_toward_the_round_start_global_model():
    lam = 0.7
    options = {"lam": lam, "personal_steps": 4}
    sim = Simulation(ragged_experiment("ditto", participation=0.5, options=options), None)
    personal: dict[int, dict] = {}
    sharp = 0.0
    for t in range(3):
        cohort, downlink, _, clients = round_inputs(sim, t)
        copies = []
        for i, data in zip(cohort, clients, strict=True):
            loss = cross_entropy(4)
            copy = descend(downlink, BODY + HEAD, loss, steps_of(data))
            start = personal.get(int(i), downlink)  # v_k starts from w^t at the first visit
            steps = steps_of(data, "personal")
            personal[int(i)] = descend(start, BODY + HEAD, proximal(loss, lam, downlink), steps)
            toward_copy = descend(start, BODY + HEAD, proximal(loss, lam, copy), steps)
            sharp = max(
                sharp, float((toward_copy["head.bias"] - personal[int(i)]["head.bias"]).abs().max())
            )
            copies.append(copy)
        sim.run_round(t)
        assert_close(sim.server["params"], averaged(downlink, copies, clients))
        for i in cohort:
            state = sim.store.get(int(i))
            assert float(state.pop("fresh")) == 0.0
            assert_close(state, personal[int(i)])
    assert sharp > 1e-6  # anchoring on the updated copy instead would be caught
    downlink, rows = evaluation_rows(sim, 3)
    for i in range(sim.exp.data.num_clients):  # predictions use v_k (w before the first visit)
        assert_row_matches(sim, row_of(rows, i), personal.get(i, downlink), 4)


# --- Local ------------------------------------------------------------------------------------


def test_local_never_changes_the_server_and_equals_independent_training():
    settings = {"batch_size": 4, "local_epochs": 1.0}  # a server optimizer is refused
    sim = Simulation(ragged_experiment("local", participation=0.5, **settings), None)
    w0 = {k: v.clone() for k, v in sim.server["params"].items()}
    opt0 = {k: v.clone() for k, v in sim.server["opt"].items()}
    models: dict[int, dict] = {}
    for t in range(4):
        cohort, downlink, states, clients = round_inputs(sim, t)
        out, _ = sim.backend(
            sim.algorithm, downlink, states, sim.round_inputs(t, cohort), sim.context(t)
        )
        assert out.upload == {}  # nothing is sent
        for i, data in zip(cohort, clients, strict=True):
            alone = models.get(int(i), w0)
            models[int(i)] = descend(
                alone, BODY + HEAD, cross_entropy(classes(data)), steps_of(data)
            )
        sim.run_round(t)
        for k, v in w0.items():
            assert torch.equal(sim.server["params"][k], v)
        for k, v in opt0.items():
            assert torch.equal(sim.server["opt"][k], v)
    assert len(models) > 1
    for i, model in models.items():
        assert_close(sim.store.get(i), model)


# --- FedAvg+ ----------------------------------------------------------------------------------


@pytest.mark.parametrize("settings", [{}, {"batch_size": 4}], ids=["full-batch", "minibatch"])
def test_fedavg_plus_is_fedavg_whose_fine_tuned_copies_never_reach_the_store(settings):
    sims = {
        name: Simulation(ragged_experiment(name, **settings), None)
        for name in ("fedavg+", "fedavg")
    }
    for sim in sims.values():
        for t in range(2):
            sim.run_round(t)
    for k, v in sims["fedavg"].server["params"].items():
        assert torch.equal(sims["fedavg+"].server["params"][k], v)
    plus = sims["fedavg+"]
    server = {k: v.clone() for k, v in plus.server["params"].items()}
    record = plus.evaluate(2)
    assert plus.store.tensors == {}
    for k, v in server.items():
        assert torch.equal(plus.server["params"][k], v)
    assert record["test_acc_before_adapt"] == pytest.approx(
        sims["fedavg"].evaluate(2)["test_acc"], abs=1e-12
    )
    downlink, rows = evaluation_rows(plus, 2)
    inputs = plus.personalization(2).inputs(np.arange(plus.exp.data.num_clients))
    for i in range(plus.exp.data.num_clients):
        n = int(plus.exp.data.train_sizes[i])
        idx, mask = inputs.batches[i], inputs.batch_mask[i]
        real = [(r, m) for r, m in zip(idx, mask, strict=True) if m.sum() > 0]
        assert len(real) == (1 if not settings else -(-n // 4))  # one local epoch
        x, y = split(plus, i, "train")
        tuned = descend(
            downlink, BODY + HEAD, cross_entropy(4), [(x[r[m > 0]], y[r[m > 0]]) for r, m in real]
        )
        assert_row_matches(plus, row_of(rows, i), tuned, 4)


# --- unseen clients ---------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["fedrep", "fedbabu", "fedrecon", "ditto", "local", "fedavg+"])
def test_unseen_clients_personalize_with_join(name):
    sim = Simulation(tiny_experiment(algorithm=name, unseen_fraction=0.34), None)
    assert sim.exp.unseen is not None
    for t in range(2):
        sim.run_round(t)
    record = sim.evaluate(2)
    ctx = sim.context(2)
    payload = sim.algorithm.downlink(sim.server, ctx)
    offset = sim.exp.data.num_clients
    states = {}
    first = [sim.init_state(offset + j, payload, ctx) for j in range(sim.exp.unseen.num_clients)]
    if first[0]:
        states = {k: torch.stack([s[k] for s in first]) for k in first[0]}
    without_join, _ = evaluate_pools(sim.algorithm, payload, states, sim.unseen_pools)
    assert record["unseen_train_loss"] < without_join["train_loss"]


# --- labels=local: a shared head over each client's own classes --------------------------------


def test_local_labels_give_shared_heads_k_max_outputs_and_leave_personal_heads_alone():
    settings = {"classes_per_client": 2, "participation": 1.0}
    relabelled = tiny_experiment(algorithm="fedavg", labels="local", **settings)
    data = relabelled.data
    assert data.num_classes == data.max_classes == 2
    assert torch.equal(data.y_train, data.y_train_local)
    assert torch.equal(data.y_test, data.y_test_local)
    assert relabelled.algorithm.init_params(0)["head.weight"].shape[0] == 2
    sims = {
        labels: Simulation(tiny_experiment(algorithm="pflego", labels=labels, **settings), None)
        for labels in ("global", "local")
    }
    for sim in sims.values():
        sim.run_round(0)
    for k, v in sims["global"].server["params"].items():
        assert torch.equal(sims["local"].server["params"][k], v)
    assert sims["local"].evaluate(1) == sims["global"].evaluate(1)


def test_local_labels_on_omniglot_are_each_characters_index_in_its_alphabet(tmp_path, monkeypatch):
    from data_formats import OMNIGLOT_LAYOUT, write_omniglot_zips

    monkeypatch.setenv("PFLEGO_NO_DOWNLOAD", "1")
    monkeypatch.setenv("PFLEGO_CACHE", str(tmp_path / "cache"))
    write_omniglot_zips(tmp_path / "omniglot")
    settings = {"dataset": "omniglot", "data_dir": str(tmp_path), "clients": 3}
    plain = tiny_experiment(algorithm="fedavg", **settings).data
    local = tiny_experiment(algorithm="fedavg", labels="local", **settings).data
    sizes = [n for alphabets in OMNIGLOT_LAYOUT.values() for n in alphabets.values()]
    assert plain.num_classes == sum(sizes) and local.num_classes == max(sizes)
    first = np.cumsum([0] + sizes[:-1])  # characters are numbered alphabet by alphabet
    for i in range(3):
        sl = plain.train_slice(i)
        expected = plain.y_train[sl] - int(first[i])
        assert torch.equal(local.y_train[sl], expected)
        assert set(expected.tolist()) == set(range(sizes[i]))


# --- presets ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "preset", ["pflego-omniglot", "pflego-omniglot-tau", "pflego-cifar10-participation"]
)
def test_paper_presets_name_valid_settings_and_options(preset):
    from importlib import resources

    import yaml

    from pflego.algorithms import build_algorithm
    from pflego.config import load_config
    from pflego.models import build_model

    spec = yaml.safe_load(resources.files("pflego.configs").joinpath(f"{preset}.yaml").read_text())
    assert {"description", "paper", "data", "settings", "algorithms", "metric", "source"} <= set(
        spec
    )
    rows = spec["algorithms"]
    for block in spec.get("paper_results", {}).values():
        assert set(block) <= set(rows)
    model = build_model("mlp", (1, 4, 4), 4, 2)
    for row, overrides in rows.items():
        values = {**spec["settings"], "algorithm": row, **overrides}
        for key, points in spec.get("sweep", {"seed": [0]}).items():
            for point in points:
                config = load_config(values, **{key: point})
                build_algorithm(config.algorithm, model, config.options)
        load_config(values, **spec["quick"])
