"""Conventional pFL rounds, written the way the common pFL libraries run them (not part of pflego).

This is the baseline of ``pflego bench --against conventional``. Every sampled client gets a
``copy.deepcopy`` of an ``nn.Module``, reads its data through ``DataLoader(batch_size,
shuffle=True)``, trains with ``torch.optim.SGD`` and ``loss.backward()``, and clients run one after
another; evaluation goes client by client through ``DataLoader``s of the training batch size (as
PFLlib evaluates), over every client's test and training data, of the models pflego reports (for
pFedMe and Per-FedAvg, the global model too).

FedAvg averages whole models by N_i; FedPer averages the body and keeps each client's last layer;
Ditto trains the global copy as FedAvg and a personal model on ``F_k(v) + lam/2 ||v - w^t||^2``;
pFedMe takes ``K`` steps on ``f_i(theta) + lam/2 ||theta - w_i||^2`` per minibatch and moves
``w_i <- w_i - lr * lam * (w_i - theta)``, and the server mixes ``(1 - beta) w + beta mean w_i``.
APFL trains, per minibatch, the global copy w on its loss and the local model v on the loss of
the mixture ``alpha v + (1 - alpha) w`` (one backward pass through both), and predicts with the
mixture; Per-FedAvg (first order) takes, per pair of minibatches, a step of ``alpha`` from a saved
copy, the gradient there, and a step of ``lr`` with it from the saved copy, and personalizes by one
step of ``alpha`` on a training minibatch before evaluation.
PGFed (as the authors' code, with the exact per-j gradient of Eq. 11) keeps ``A = [a_ij]`` and the
last cohort's full-batch gradients ``g_j`` and offsets ``mu (f_j(theta_j) - g_j^T theta_j)`` on the
server; client i downloads them with its row ``a_i``, adds ``mu sum_j a_ij g_j`` to every minibatch
gradient, takes the round's steps of ``lam`` on ``a_i`` at once after the loop (they need only the
sum of the iterates; the authors' code takes one product with the mean g_j per minibatch instead),
clips it at 0, and uploads its model, ``a_i``, its full-batch gradient and offset; it predicts with
its model.
Heads are C-way (global labels), as in those libraries. On a GPU (``device``) the model lives
there and each minibatch moves there when it is used, as in PFLlib.

Usage (from a source checkout): ``pflego bench --against conventional``; or

    PYTHONPATH=src python -c "from benchmarks.conventional import demo; demo()"
"""

from __future__ import annotations

import copy
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import Tensor, nn
from torch.nn.utils import parameters_to_vector
from torch.utils.data import DataLoader, TensorDataset

ALGORITHMS = ("fedavg", "fedper", "ditto", "pfedme", "apfl", "perfedavg", "pgfed")

#: Defaults of the options the algorithms take (those of pflego's implementations).
DEFAULTS = {
    "ditto": {"lam": 0.1},
    "pfedme": {"lam": 15.0, "K": 5, "personal_lr": 0.09, "beta": 1.0},
    "apfl": {"alpha": 0.5},
    "perfedavg": {"alpha": 0.005},
    "pgfed": {"mu": 0.1, "lam": 0.01},
}

#: ``sampler_for(round, client)`` -> the sample order of each local epoch (tests only).
SamplerFor = Callable[[int, int], Sequence[Sequence[int]]]


def split_module(body: nn.Module, feature_dim: int, num_classes: int) -> nn.Module:
    """``body`` followed by a C-way linear ``head``, with pflego's parameter names."""
    net = nn.Sequential(
        OrderedDict(body=copy.deepcopy(body), head=nn.Linear(feature_dim, num_classes))
    )
    return net.requires_grad_(True)  # pflego's modules hold no trainable state: these do


@dataclass
class ClientSplit:
    """One client's training and test samples (global labels)."""

    x_train: Tensor
    y_train: Tensor
    x_test: Tensor
    y_test: Tensor


def client_splits(data) -> list[ClientSplit]:
    """Every client of a pflego ``FederatedData`` as tensors a ``DataLoader`` can read."""
    x_train, x_test = data.inputs(data.x_train), data.inputs(data.x_test)
    splits = []
    for i in range(data.num_clients):
        tr, te = data.train_slice(i), data.test_slice(i)
        splits.append(ClientSplit(x_train[tr], data.y_train[tr], x_test[te], data.y_test[te]))
    return splits


@dataclass
class ConventionalFL:
    """A conventional implementation of one algorithm over fixed clients.

    Attributes:
        algorithm: One of :data:`ALGORITHMS`.
        model: The global model (a ``body`` and a ``head``), already initialized.
        clients: Every client's data.
        batch_size: Minibatch size of training and evaluation loaders.
        epochs: Local epochs per round.
        lr: Client step size (pFedMe's eta).
        options: The algorithm's options (see :data:`DEFAULTS`).
        seed: Seeds the loaders' shuffling.
        sampler_for: Fixed sample orders instead of shuffling (tests compare with pflego).
        device: Where the models train and evaluate (the data stays on the CPU).
    """

    algorithm: str
    model: nn.Module
    clients: list[ClientSplit]
    batch_size: int = 10
    epochs: int = 1
    lr: float = 0.01
    options: dict = field(default_factory=dict)
    seed: int = 0
    sampler_for: SamplerFor | None = None
    device: str = "cpu"
    personal: dict[int, object] = field(default_factory=dict)
    #: PGFed's server: A (created with the first cohort), and the last cohort's and this
    #: cohort's uploads ``(j, g_j, mu (f_j(theta_j) - g_j^T theta_j))``.
    alpha_mat: Tensor | None = None
    previous_uploads: list[tuple[int, Tensor, Tensor]] = field(default_factory=list)
    uploads: list[tuple[int, Tensor, Tensor]] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.algorithm not in ALGORITHMS:
            raise ValueError(f"unknown algorithm {self.algorithm!r}; choose one of {ALGORITHMS}")
        self.options = {**DEFAULTS.get(self.algorithm, {}), **self.options}
        self.model = self.model.to(self.device)
        self.loss = nn.CrossEntropyLoss()

    # --- training -----------------------------------------------------------------------------

    def loader(self, t: int, client: int, epoch: int) -> Iterator[tuple[Tensor, Tensor]]:
        """Client ``client``'s minibatches of local epoch ``epoch`` of round ``t``, on the device."""
        data = self.clients[client]
        dataset = TensorDataset(data.x_train, data.y_train)
        if self.sampler_for is not None:
            order = list(self.sampler_for(t, client)[epoch])
            return self.on_device(DataLoader(dataset, batch_size=self.batch_size, sampler=order))
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + t * 10_007 + client)
        shuffled = DataLoader(
            dataset, batch_size=self.batch_size, shuffle=True, generator=generator
        )
        return self.on_device(shuffled)

    def on_device(self, batches: DataLoader) -> Iterator[tuple[Tensor, Tensor]]:
        """Each ``(x, y)`` of ``batches`` moved to the device as it is used."""
        return ((x.to(self.device), y.to(self.device)) for x, y in batches)

    def sgd_epochs(
        self, model: nn.Module, t: int, client: int, anchor: nn.Module | None = None
    ) -> None:
        """Local epochs of SGD; with ``anchor``, on ``loss + lam/2 ||model - anchor||^2``."""
        optimizer = torch.optim.SGD(model.parameters(), lr=self.lr)
        model.train()
        for epoch in range(self.epochs):
            for x, y in self.loader(t, client, epoch):
                optimizer.zero_grad()
                loss = self.loss(model(x), y)
                if anchor is not None:
                    prox = sum(
                        ((p - a.detach()) ** 2).sum()
                        for p, a in zip(model.parameters(), anchor.parameters())
                    )
                    loss = loss + self.options["lam"] / 2 * prox
                loss.backward()
                optimizer.step()

    def train_round(self, t: int, cohort: Sequence[int]) -> None:
        """One round: the cohort trains one client after another, then the server aggregates."""
        sizes = np.array([len(self.clients[i].y_train) for i in cohort], np.float64)
        weights = sizes / sizes.sum()
        if self.algorithm in ("pfedme", "perfedavg"):
            weights = np.full(len(cohort), 1.0 / len(cohort))
        if self.algorithm == "pgfed" and self.alpha_mat is None:
            dtype = next(self.model.parameters()).dtype
            self.alpha_mat = torch.full(
                (len(self.clients),) * 2, 1 / len(cohort), dtype=dtype, device=self.device
            )
        uploads = []
        for i in cohort:
            uploads.append(getattr(self, f"_{self.algorithm}_client")(t, int(i)))
        self.previous_uploads, self.uploads = self.uploads, []
        average = {k: sum(float(w) * u[k] for w, u in zip(weights, uploads)) for k in uploads[0]}
        state = self.model.state_dict()
        if self.algorithm == "pfedme":
            beta = self.options["beta"]
            average = {k: (1 - beta) * state[k] + beta * v for k, v in average.items()}
        state.update(average)
        self.model.load_state_dict(state)

    def _fedavg_client(self, t: int, i: int) -> dict[str, Tensor]:
        local = copy.deepcopy(self.model)
        self.sgd_epochs(local, t, i)
        return local.state_dict()

    def _fedper_client(self, t: int, i: int) -> dict[str, Tensor]:
        local = copy.deepcopy(self.model)
        if i in self.personal:
            local.head.load_state_dict(self.personal[i])
        self.sgd_epochs(local, t, i)
        self.personal[i] = copy.deepcopy(local.head.state_dict())
        return {k: v for k, v in local.state_dict().items() if k.startswith("body.")}

    def _ditto_client(self, t: int, i: int) -> dict[str, Tensor]:
        personal = self.personal[i] if i in self.personal else copy.deepcopy(self.model)
        self.sgd_epochs(personal, t, i, anchor=self.model)
        self.personal[i] = personal
        return self._fedavg_client(t, i)

    def _pfedme_client(self, t: int, i: int) -> dict[str, Tensor]:
        lam, steps, personal_lr = (self.options[k] for k in ("lam", "K", "personal_lr"))
        local = copy.deepcopy(self.model)  # w_i
        theta = copy.deepcopy(self.model)
        optimizer = torch.optim.SGD(theta.parameters(), lr=personal_lr)
        for epoch in range(self.epochs):
            for x, y in self.loader(t, i, epoch):
                for _ in range(steps):  # theta ~ argmin f_i(theta; D) + lam/2 ||theta - w_i||^2
                    optimizer.zero_grad()
                    loss = self.loss(theta(x), y)
                    prox = sum(
                        ((p - w.detach()) ** 2).sum()
                        for p, w in zip(theta.parameters(), local.parameters())
                    )
                    (loss + lam / 2 * prox).backward()
                    optimizer.step()
                with torch.no_grad():
                    for w, p in zip(local.parameters(), theta.parameters()):
                        w.sub_(self.lr * lam * (w - p))
        self.personal[i] = theta
        return local.state_dict()

    def _apfl_client(self, t: int, i: int) -> dict[str, Tensor]:
        alpha = self.options["alpha"]
        local = copy.deepcopy(self.model)  # w_i
        personal = self.personal[i] if i in self.personal else copy.deepcopy(self.model)  # v_i
        optimizer = torch.optim.SGD([*local.parameters(), *personal.parameters()], lr=self.lr)
        names = [k for k, _ in local.named_parameters()]
        for epoch in range(self.epochs):
            for x, y in self.loader(t, i, epoch):
                optimizer.zero_grad()
                mixed = {
                    k: alpha * v + (1 - alpha) * w.detach()
                    for k, v, w in zip(names, personal.parameters(), local.parameters())
                }
                mixed_out = torch.func.functional_call(local, mixed, (x,))
                (self.loss(local(x), y) + self.loss(mixed_out, y)).backward()
                optimizer.step()
        self.personal[i] = personal
        return local.state_dict()

    def _perfedavg_client(self, t: int, i: int) -> dict[str, Tensor]:
        alpha = self.options["alpha"]
        local = copy.deepcopy(self.model)
        optimizer = torch.optim.SGD(local.parameters(), lr=alpha)
        batches = [b for epoch in range(2 * self.epochs) for b in self.loader(t, i, epoch)]
        for (x, y), (x2, y2) in zip(batches[0::2], batches[1::2]):
            saved = copy.deepcopy(list(local.parameters()))
            optimizer.zero_grad()
            self.loss(local(x), y).backward()
            optimizer.step()  # w' = w - alpha grad f(w; D)
            optimizer.zero_grad()
            self.loss(local(x2), y2).backward()  # grad f(w'; D')
            with torch.no_grad():
                for p, w in zip(local.parameters(), saved):
                    p.copy_(w - self.lr * p.grad)
        return local.state_dict()

    def _pgfed_client(self, t: int, i: int) -> dict[str, Tensor]:
        mu, lam = self.options["mu"], self.options["lam"]
        local = copy.deepcopy(self.model)
        flat, previous = parameters_to_vector(local.parameters()), self.previous_uploads
        ids = [j for j, _, _ in previous]  # download a_i and the last cohort's g_j and offsets
        a_i = self.alpha_mat[i, ids].clone()
        grads = torch.stack([g for _, g, _ in previous]) if ids else flat.new_zeros(0, len(flat))
        offsets = torch.stack([o for _, _, o in previous]) if ids else flat.new_zeros(0)
        sizes = [p.numel() for p in local.parameters()]
        aux = (mu * a_i @ grads).split(sizes)  # g~_i, fixed for the round
        optimizer = torch.optim.SGD(local.parameters(), lr=self.lr)
        iterate_sum, steps = torch.zeros_like(flat), 0
        local.train()
        for epoch in range(self.epochs):
            for x, y in self.loader(t, i, epoch):
                optimizer.zero_grad()
                self.loss(local(x), y).backward()
                with torch.no_grad():
                    iterate_sum += parameters_to_vector(local.parameters())
                    for p, g in zip(local.parameters(), aux):
                        p.grad += g.view_as(p)
                optimizer.step()
                steps += 1
        # Eq. 11 for every j at every step's point: a_i's steps add up to one step on the sum
        # of the iterates (g~_i is fixed, so the iterates do not depend on a_i)
        a_i -= lam * (steps * offsets + mu * grads @ iterate_sum)
        self.alpha_mat[i, ids] = a_i.clamp(min=0)  # upload a_i
        data = self.clients[i]
        local.zero_grad()
        x, y = data.x_train.to(self.device), data.y_train.to(self.device)
        loss = self.loss(local(x), y)  # f_i and g_i at the final model
        loss.backward()
        with torch.no_grad():
            grad = parameters_to_vector(p.grad for p in local.parameters())
            offset = mu * (loss - grad @ parameters_to_vector(local.parameters()))
        self.uploads.append((i, grad, offset))
        self.personal[i] = local
        return local.state_dict()

    # --- evaluation ---------------------------------------------------------------------------

    def client_model(self, i: int) -> nn.Module:
        """The model client ``i`` is evaluated with."""
        if self.algorithm == "fedper":
            model = copy.deepcopy(self.model)
            if i in self.personal:
                model.head.load_state_dict(self.personal[i])
            return model
        if self.algorithm in ("ditto", "pfedme", "pgfed"):
            return self.personal.get(i, self.model)
        if self.algorithm == "apfl" and i in self.personal:
            alpha, model = self.options["alpha"], copy.deepcopy(self.model)
            with torch.no_grad():
                for w, v in zip(model.parameters(), self.personal[i].parameters()):
                    w.mul_(1 - alpha).add_(v, alpha=alpha)
            return model
        if self.algorithm == "perfedavg":  # one step of alpha on a training minibatch
            model = copy.deepcopy(self.model)
            x, y = next(iter(self.loader(0, i, 0)))
            with torch.enable_grad():
                self.loss(model(x), y).backward()
            with torch.no_grad():
                for p in model.parameters():
                    p.sub_(self.options["alpha"] * p.grad)
            return model
        return self.model

    def extra_views(self) -> dict[str, nn.Module]:
        """The other models pflego reports beside the personalized one, by its metric suffix:
        pFedMe's global model (its authors' code evaluates both every round) and Per-FedAvg's
        model before its personalization step (the same global model)."""
        if self.algorithm == "pfedme":
            return {"_global": self.model}
        if self.algorithm == "perfedavg":
            return {"_before_adapt": self.model}
        return {}

    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        """Every client, one after another: test accuracy (mean over clients) and the training
        loss (weighted by N_i), of its personalized model and of each of :meth:`extra_views`."""
        extra = self.extra_views()
        accuracies, losses, sizes = {v: [] for v in ("", *extra)}, {v: [] for v in ("", *extra)}, []
        for i, data in enumerate(self.clients):
            for view, model in {"": self.client_model(i), **extra}.items():
                model.eval()
                correct = total = 0
                test = DataLoader(TensorDataset(data.x_test, data.y_test), self.batch_size)
                for x, y in self.on_device(test):
                    correct += int((model(x).argmax(1) == y).sum())
                    total += len(y)
                loss_sum = 0.0
                train = DataLoader(TensorDataset(data.x_train, data.y_train), self.batch_size)
                for x, y in self.on_device(train):
                    loss_sum += float(self.loss(model(x), y)) * len(y)
                accuracies[view].append(correct / max(total, 1))
                losses[view].append(loss_sum / max(len(data.y_train), 1))
            sizes.append(len(data.y_train))
        alpha = np.array(sizes, np.float64) / sum(sizes)
        metrics = {}
        for view in accuracies:
            metrics[f"test_acc{view}"] = float(np.mean(accuracies[view]))
            metrics[f"train_loss{view}"] = float(alpha @ losses[view])
        return metrics


def time_rounds(
    runner: ConventionalFL, cohorts: Sequence[Sequence[int]], first_round: int = 0
) -> list[float]:
    """Wall-clock seconds of each round of ``cohorts``."""
    seconds = []
    for t, cohort in enumerate(cohorts, first_round):
        start = time.perf_counter()
        runner.train_round(t, cohort)
        if torch.cuda.is_initialized():  # CUDA kernels run asynchronously: wait for them
            torch.cuda.synchronize()
        seconds.append(time.perf_counter() - start)
    return seconds


def demo(clients: int = 20, rounds: int = 2) -> None:
    """A few conventional rounds on the embedded MNIST sample, with timings."""
    from pflego.config import load_config
    from pflego.sim import build_experiment

    exp = build_experiment(load_config({"clients": clients, "batch_size": 10}))
    params = exp.algorithm.init_params(0)
    model = exp.algorithm.model
    for name in ALGORITHMS:
        net = split_module(model.body, model.feature_dim, model.num_classes)
        net.load_state_dict(
            {**params, **{k: v for k, v in net.state_dict().items() if k.startswith("head.")}}
        )
        runner = ConventionalFL(name, net, client_splits(exp.data))
        rng = np.random.default_rng(0)
        cohorts = [np.sort(rng.choice(clients, clients // 5, replace=False)) for _ in range(rounds)]
        print(name, [f"{s:.2f}s" for s in time_rounds(runner, cohorts)], runner.evaluate())
