"""pflego on Flower: one generic ClientApp and one generic server loop for every algorithm.

Flower is an optional extra (``pip install pflego[flower]``); nothing outside this package imports
it, and importing this package itself does not either (its modules do).

Its modules, one concern each, are listed in ``docs/flower.md`` ("Pieces"); the ``pflego
flower`` commands are in ``pflego.cli.flower`` (a layer above this package).

The server holds no data: it learns I, N and each N_i from the nodes (see ``population``). Missing
nodes and PFLEGO's unbiased step: a round aggregates the uploads that arrived. Let S be the
sampled set (exactly r clients, or each client with probability p) and A ⊆ S the clients that
answered. The server passes ``aggregate`` a context whose cohort size is ``r·q̂`` with
``q̂ = |A|/|S|``, so PFLEGO's body step uses ``(I / (r q̂)) Σ_{i∈A} α_i g_i``. If, given S and |A|,
every subset of S of that size is equally likely to be the one that answers (failures independent
of which client it is), then ``E[Σ_{i∈A} α_i g_i | S, |A|] = q̂ Σ_{i∈S} α_i g_i``: given S and
at least one answer, the step's expectation is the simulator's step ``(I/r) Σ_{i∈S} α_i g_i``
for that S, with no need to know the failure rate. With exactly r sampled clients it is
therefore unbiased for ∇_θ L given at least one answer; with Bernoulli sampling it is unbiased
given the cohort, and overall only up to the rounds in which all of S failed. It is NOT unbiased
when failures depend on the client (a node that is always down, slow clients that always time
out): then it estimates the gradient of the loss of the clients that do answer. A personal head
W_i is stepped on its node before the reply is sent: its step is exact whenever the client ran
(even if the reply is then lost); a client that fails before running takes no head step, so its
head's expected step is scaled by its completion rate. See ``docs/flower.md``.
"""
