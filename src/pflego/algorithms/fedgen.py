"""FedGen: a server-side generator of features, learned from the clients' heads, regularizes them.

Zhu, Hong, Zhou. "Data-Free Knowledge Distillation for Heterogeneous Federated Learning".
ICML 2021; arXiv:2105.10056. Authors' code: github.com/zhuangdizhu/FedGen; FL-bench's
``src/{server,client}/fedgen.py`` and PFLlib's ``serverfedgen.py`` (TsingZ0/PFLlib) read for the
details below.

FedAvg on the whole model theta = (body, head h), plus a conditional generator G_w(z, y) of
features in the head's input space, trained on the server so that the clients' heads, as an
ensemble weighted by their share of each label, classify its features as their label:

    min_w  E_{y, z} [ sum_k c_k(y) CE(h_k(G_w(z, y)), y) ],   c_k(y) = n_k(y) / sum_j n_j(y)

(the authors' ``teacher_loss``; y uniform over the labels the cohort holds on average more than
``min_samples`` samples of, z ~ N(0, I)). Client k's local objective adds two terms from the
generator (from the second round on, when it has been trained once):

    L_k(theta) = CE(f(x), y) + beta_t KL(softmax(h(G(z, y))) || softmax(f(x)))
                 + alpha_t E_{y' ~ U(Y_k), z} CE(h(G(z, y')), y')

with h(G(z, y)) detached in the KL (FL-bench's ``latent_loss``), Y_k the client's labels and
``alpha_t = max(1e-4, alpha * decay^t)``, ``beta_t`` likewise (the authors' ``exp_coef_scheduler``).

Symbols to code: w -> ``server["generator"]`` (Adam state ``server["generator_opt"]``), z's width
and G's hidden width -> ``noise_dim``, ``hidden_dim``; alpha, beta, decay -> ``alpha``, ``beta``,
``decay``; the generator's Adam steps per round and step size -> ``generator_steps``,
``generator_lr`` (decayed by 0.98 a round, FL-bench's scheduler); n_k(y) -> the upload's
``label_counts``; h_k -> the head of client k's trained model, the server's minus its upload.
Defaults are FL-bench's (``generative_alpha`` = ``generative_beta`` = 10, ``coef_decay`` 0.98,
``ensemble_lr`` 3e-4, ``train_generator_epoch`` 5, ``noise_dim`` = ``hidden_dim`` = 32,
``gen_batch_size`` 32, ``min_samples_per_label`` 1).

The server-side generator (the contract extension, docs/design.md): its parameters and optimizer
live in the server state and are trained in ``server_round`` on the cohort's uploads; clients draw
no random numbers (every backend and Flower node must agree), so the server draws each round's
noise from the run's seed and the round and sends the generator's samples, a bank of
``bank_size`` features per class (``generated``, ``[C, bank_size, M]``), in the shared downlink
(``pflego.models.generator``).

Deliberate differences and choices:
- Client samples: the KL term pairs batch row s with the bank's feature ``bank[y_s, s mod n]``
  (a fresh z per row in the authors' code), and the alpha term is the exact mean over the client's
  labels of the bank's n features each (the authors draw ``gen_batch_size`` labels from Y_k; the
  ratio ``gen_batch_size / batch_size``, 1 at the defaults, is not applied).
- The generator: ``Linear(noise + C, hidden) -> ReLU -> Linear(hidden, M)`` on (z, onehot y); the
  authors' and FL-bench's have a batch norm after the first layer, left out (its batch statistics
  would tie every sample to the batch it is drawn in); ``nn.Linear``'s initialization.
- Only the teacher term trains the generator: the authors' diversity term (FL-bench's
  ``ensemble_eta`` 0) and the student KL against the global model (``ensemble_beta`` 0) are off
  at FL-bench's defaults and not offered. FL-bench's teacher term applies the server's own
  classifier for every client (its teacher model is loaded but unused); here each client's own
  trained head, as in the paper and the authors' code.
- The model's local steps are the run's (FL-bench adds an exponential decay of the client lr).
- Clients weigh N_k in the model average (FedAvg's, as the authors').

Prediction is the global model's; a client that never trained uses it as it is (no ``join``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor

from pflego import tree
from pflego.algorithms.base import Algorithm, register
from pflego.fields import at_least, between, non_negative, positive, setting
from pflego.local import train_steps
from pflego.loss import masked_cross_entropy
from pflego.models import head_logits
from pflego.models.generator import Generator
from pflego.optim import Adam
from pflego.rng import seed_for
from pflego.tree import Params
from pflego.types import ClientData, ClientOut, RoundContext, ServerState

COUNTS = "label_counts"
BANK = "generated"
HEAD = ("head.weight", "head.bias")


@register("fedgen")
@dataclass(frozen=True)
class FedGen(Algorithm):
    """FedGen (see the module docstring)."""

    alpha: float = setting(10.0, "weight of the generated samples' cross-entropy", non_negative)
    beta: float = setting(10.0, "weight of the KL to the generated features' logits", non_negative)
    decay: float = setting(0.98, "per-round decay of alpha and beta", between(0, 1, "(]"))
    generator_lr: float = setting(3e-4, "Adam step size of the generator", positive)
    generator_steps: int = setting(5, "generator steps per round on the server", at_least(1))
    noise_dim: int = setting(32, "width of the generator's noise", at_least(1))
    hidden_dim: int = setting(32, "width of the generator's hidden layer", at_least(1))
    bank_size: int = setting(
        32, "generated features per class (and per generator step)", at_least(1)
    )
    min_samples: float = setting(
        1.0, "labels the cohort holds fewer of per client are not generated", non_negative
    )

    sum_aggregate: ClassVar[bool] = False  # the generator reads every client's head
    join_trains: ClassVar[bool] = False

    @property
    def generator(self) -> Generator:
        return Generator(self.noise_dim, self.hidden_dim, self.model.num_classes)

    def coefficient(self, value: float, ctx: RoundContext) -> float:
        """The authors' ``exp_coef_scheduler``: max(1e-4, value * decay^t)."""
        return max(1e-4, value * self.decay**ctx.round)

    # --- server ---------------------------------------------------------------------------------

    def generator_state(self, server: ServerState, ctx: RoundContext) -> tuple[Params, Params]:
        """w and its Adam state; created at first use, seeded by the run's seed."""
        if "generator" in server:
            return server["generator"], server["generator_opt"]
        like = server["params"]["head.weight"]
        gen = torch.Generator().manual_seed(seed_for(ctx.seed, 23))
        w = self.generator.init(self.model.feature_dim, gen, like)
        return w, Adam().init(w)

    def downlink(
        self, server: ServerState, ctx: RoundContext, clients: Tensor | None = None
    ) -> Params:
        """The global model and the round's bank of generated features, ``[C, n, M]``."""
        w, _ = self.generator_state(server, ctx)
        gen = torch.Generator().manual_seed(seed_for(ctx.seed, 24, ctx.round))
        return {**server["params"], BANK: self.generator.bank(w, self.bank_size, gen)}

    def evaluation_downlink(self, server, ctx, clients=None) -> Params:
        return server["params"]

    def server_round(
        self, server: ServerState, out: ClientOut, ctx: RoundContext, clients: Tensor
    ) -> ServerState:
        """FedAvg on the model, then ``generator_steps`` Adam steps on the teacher loss."""
        model = {k: v for k, v in out.upload.items() if k != COUNTS}
        new = self.server_update(server, self.aggregate(out._replace(upload=model), ctx), ctx)
        heads = {k: server["params"][k] - model[k] for k in HEAD}  # each client's trained head
        w, opt = self.generator_state(server, ctx)
        counts = out.upload[COUNTS]
        shares = counts / counts.sum(0).clamp(min=1e-8)  # c_k(y), [r, C]
        qualified = counts.sum(0) / len(counts) > self.min_samples
        labels = torch.where(qualified.any(), qualified, counts.sum(0) > 0).to(counts)
        lr = self.generator_lr * 0.98**ctx.round
        for step in range(self.generator_steps):
            gen = torch.Generator().manual_seed(seed_for(ctx.seed, 25, ctx.round, step))
            y = torch.multinomial(labels.cpu(), self.bank_size, True, generator=gen).to(
                counts.device
            )
            z = torch.randn((self.bank_size, self.noise_dim), generator=gen, dtype=torch.float32)
            z = z.to(counts)
            grad = torch.func.grad(self.teacher_loss)(w, z, y, heads, shares)
            w, opt = Adam().update(w, grad, opt, lr)
        return {**new, "generator": w, "generator_opt": opt}

    def teacher_loss(self, w: Params, z: Tensor, y: Tensor, heads: Params, shares: Tensor):
        """sum_k mean_s c_k(y_s) CE(h_k(G(z_s, y_s)), y_s) over the cohort's heads."""
        features = self.generator.forward(w, z, y)
        logits = torch.einsum("sm,kcm->ksc", features, heads["head.weight"])
        logits = logits + heads["head.bias"][:, None, :]
        ce = F.cross_entropy(logits.transpose(1, 2), y.expand(len(logits), -1), reduction="none")
        return (shares[:, y] * ce).mean(1).sum()

    # --- client ---------------------------------------------------------------------------------

    def client_update(self, downlink, state, data: ClientData, ctx: RoundContext):
        """Local steps on CE plus, once the generator has trained, its two terms; uploads the
        model's pseudo-gradient and the client's label counts."""
        params = {k: v for k, v in downlink.items() if k != BANK}
        hits = (data.y[:, None] == torch.arange(self.model.num_classes, device=data.y.device)).to(
            data.mask
        ) * data.mask[:, None]
        counts = hits.sum(0)
        loss = self.objective(downlink[BANK], (counts > 0).to(counts), data.label_mask, ctx)
        opt = self.client_optimizer
        trained, _, mean_loss = train_steps(
            loss, params, data, opt, opt.init(params), ctx.client_lr
        )
        upload = {**tree.sub(params, trained), COUNTS: counts}
        return ClientOut(upload, data.num_samples, {"loss": mean_loss}), state

    def objective(self, bank: Tensor, own: Tensor, label_mask: Tensor, ctx: RoundContext):
        """The local loss on a batch: CE, and from round 1 on beta_t KL + alpha_t CE(generated)."""
        alpha, beta = self.coefficient(self.alpha, ctx), self.coefficient(self.beta, ctx)
        regularize = ctx.round > 0
        classes = torch.arange(bank.shape[0], device=bank.device)

        def loss(p: Params, x: Tensor, y: Tensor, mask: Tensor) -> Tensor:
            logits = self.model.forward(p, x)
            ce = masked_cross_entropy(logits, y, mask, label_mask)
            if not regularize:
                return ce
            rows = torch.arange(len(y), device=y.device) % bank.shape[1]
            teacher = F.log_softmax(head_logits(p, bank[y, rows]).detach(), -1)
            kl = (teacher.exp() * (teacher - F.log_softmax(logits, -1))).sum(-1)
            kl = (mask * kl).sum() / mask.sum().clamp(min=1)
            generated = head_logits(p, bank)  # [C, n, C]
            per_class = F.cross_entropy(
                generated.transpose(1, 2),
                classes[:, None].expand(-1, bank.shape[1]),
                reduction="none",
            ).mean(1)
            gen_ce = (own * per_class).sum() / own.sum()
            return ce + beta * kl + alpha * gen_ce

        return loss
