"""pflego on Flower: one generic ClientApp and one generic server loop for every algorithm.

Flower is an optional extra (``pip install pflego[flower]``); nothing outside this package imports
it, and importing this package itself does not either (its modules do).

Modules:
    ``records``: lossless tensors <-> Flower records, and the config for the run config.
    ``population``: the task and the population a server learns from the nodes' reports.
    ``sitedata``: a site's own data (image folder, npz, CSV, IDX) fitted to the run's task.
    ``node``: what a SuperNode does for its client (partition or site data, first-visit state,
        train, evaluate, state files).
    ``apps``: the ``ServerApp`` and ``ClientApp`` (``pflego.flower.apps:server_app`` /
        ``client_app``), and the client state kept in ``context.state`` and on disk.
    ``server``: the server loop over a Flower ``Grid`` (``FlowerServer``), its checkpoint and
        resume, built on the modules that follow.
    ``membership``: the population learned from the nodes, late joiners, the server's messages
        to the nodes (downlinks, replies, missing clients).
    ``training``: a training round: the engine's round with plain or SecAgg+ messages as its
        transport.
    ``evaluation``: the evaluation rounds and the run's records.
    ``status``: bytes and seconds per round, the status line, the event log ``flower.jsonl``.
    ``unsupported``: the runs Flower's client-server rounds cannot do, refused in one line.
    ``secure``: secure aggregation of a round's sum with Flower's SecAgg+.
    ``inprocess``: a grid that runs the ClientApp in the same process (tests, debugging).
    ``deploy``: a SuperLink and N SuperNodes on 127.0.0.1 (``pflego flower local``).
    ``simulation``: a SuperLink in simulation mode with Ray's virtual SuperNodes
        (``pflego flower simulate``), and the clean-up of its private network namespace.
    ``certs``: certificates and SuperNode keys for TLS and node authentication.

The ``pflego flower`` commands are in ``pflego.cli.flower`` (a layer above this package).

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
