"""The Flower apps: one ServerApp and one ClientApp for every registered algorithm.

Point a Flower app's ``[tool.flwr.app.components]`` at ``pflego.flower.apps:server_app`` and
``pflego.flower.apps:client_app`` (the app folder shipped in ``pflego/flower/app`` does). Their
run config (``[tool.flwr.app.config]``, overridden with ``flwr run --run-config``) and node config
(``flower-supernode --node-config``: a site's own data or a partition of the run's dataset) are
listed in ``docs/flower.md`` ("Configuration").
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from flwr.app import ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.client.mod import secaggplus_mod
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid, ServerApp

from pflego import tree
from pflego.config import Config
from pflego.errors import ConfigError, DataError, PflegoError
from pflego.flower.node import ClientNode, StateFiles, load_source, local_privacy
from pflego.flower.population import Task
from pflego.flower.records import (
    client_out_to_record,
    context_from_record,
    decode_config,
    params_from_record,
    params_to_record,
)
from pflego.flower.secure import SecureAggregation, fit_inputs, fit_reply, is_fit, is_secure
from pflego.history import RunDir
from pflego.types import ClientState, RoundContext

STATE_KEY = "pflego.client-state"
STATE_TAG = "pflego.client-state-tag"

server_app = ServerApp()
client_app = ClientApp()
log = logging.getLogger("pflego.flower")


# --- client side --------------------------------------------------------------------------------


def run_config(context: Context) -> Config:
    """The run's experiment config."""
    return decode_config(str(context.run_config["pflego-config"]))


def state_files(context: Context) -> StateFiles:
    """Where this node saves client states: node config, then run config, then FLWR_HOME."""
    directory = str(context.node_config.get("state-dir", "") or "")
    directory = directory or str(context.run_config.get("state-dir", "") or "")
    if not directory:
        home = os.environ.get("FLWR_HOME") or str(Path.home() / ".flwr")
        directory = str(Path(home) / "pflego-state")
    return StateFiles(directory)


def logged(handler: Callable[[Message, Context], Message]) -> Callable[[Message, Context], Message]:
    """Log a handler's one-line error on the node before Flower sends it to the server."""

    @functools.wraps(handler)
    def wrapper(message: Message, context: Context) -> Message:
        try:
            return handler(message, context)
        except PflegoError as exc:
            log.error("pflego node %s: %s", context.node_id, exc)
            raise

    return wrapper


@client_app.query()
@logged
def query(message: Message, context: Context) -> Message:
    """Report this node's client: name, counts, label set, input shape (never samples).

    With the run's task in the message, a node whose data does not fit refuses with the reason.
    """
    report = load_source(run_config(context), dict(context.node_config)).report()
    if "task" in message.content:
        Task.from_record(message.content["task"]).check(report)
    return Message(RecordDict({"report": ConfigRecord(report.to_record())}), reply_to=message)


def round_node(records: dict[str, Any], context: Context) -> ClientNode:
    """This node's client for a round's records: the named site, with the run's task."""
    source = load_source(run_config(context), dict(context.node_config))
    site = str(records["pflego"]["site"])
    own = source.report().site
    if site != own:
        raise ConfigError(f"a message for {site} reached the node of {own}")
    node = source.node(int(records["pflego"]["client"]), Task.from_record(records["task"]))
    privacy = local_privacy(node.config, records["pflego"].get("dp-noise"))
    return dataclasses.replace(node, privacy=privacy) if privacy is not None else node


def load_state(
    context: Context, node: ClientNode, run: str, downlink, ctx: RoundContext
) -> ClientState:
    """The client's newest state from a round before ``ctx.round``: from ``context.state``, else
    from disk, else its first-visit state. Newer states (a round a restarted server repeats)
    are ignored, so a resumed run equals an uninterrupted one."""
    tag = context.state.get(STATE_TAG)
    if (
        tag is not None
        and tag["run"] == run
        and int(tag["client"]) == node.client
        and int(tag["round"]) < ctx.round
    ):
        return params_from_record(context.state[STATE_KEY])
    saved = state_files(context).load(run, node.client, before=ctx.round)
    return saved if saved is not None else node.first_visit_state(downlink, ctx)


def keep_state(context: Context, run: str, client: int, t: int, state: ClientState) -> None:
    """Save the client's state of round t on disk (atomically) and in ``context.state``."""
    state_files(context).save(run, client, t, state)
    context.state[STATE_KEY] = params_to_record(state)
    context.state[STATE_TAG] = ConfigRecord({"run": run, "client": client, "round": t})


def client_round(
    records: dict[str, Any], downlink, context: Context
) -> tuple[ClientNode, ClientState, RoundContext]:
    """This node's client for a round's records, its state before the round and the round's
    context."""
    node = round_node(records, context)
    ctx = context_from_record(records["ctx"])
    return node, load_state(context, node, str(records["pflego"]["run"]), downlink, ctx), ctx


def train_client(records: dict[str, Any], downlink, context: Context):
    """Run the client's round; keep its new state when the update is finite."""
    node, state, ctx = client_round(records, downlink, context)
    run = str(records["pflego"]["run"])
    out, new_state = node.train(downlink, state, ctx)
    finite = tree.all_finite(out.upload, new_state, {"weight": torch.as_tensor(out.weight)})
    if finite:  # a non-finite update is dropped, as in the simulator: the old state stays
        keep_state(context, run, node.client, ctx.round, new_state)
    return node, out, finite


def secure_mod(message: Message, context: Context, call_next) -> Message:
    """Flower's ``secaggplus_mod`` for SecAgg+ messages; other train messages pass through."""
    if is_secure(message):
        return secaggplus_mod(message, context, call_next)
    return call_next(message, context)


@client_app.train(mods=[secure_mod])
@logged
def train(message: Message, context: Context) -> Message:
    """Decode the downlink, run ``client_update`` on the client's state, keep the new state."""
    if is_fit(message):
        return train_secure(message, context)
    records = {k: message.content[k] for k in ("pflego", "task", "ctx")}
    downlink = params_from_record(message.content["downlink"])
    node, out, finite = train_client(records, downlink, context)
    content = RecordDict(
        {
            "out": client_out_to_record(out),
            "metrics": MetricRecord(  # scalars as floats, for Flower's logs
                {k: float(v) for k, v in {**out.metrics, "client": node.client}.items()}
            ),
            "pflego": ConfigRecord({"client": node.client, "finite": finite}),
        }
    )
    return Message(content, reply_to=message)


def train_secure(message: Message, context: Context) -> Message:
    """The SecAgg+ round's local work: the reply is a FitRes that ``secaggplus_mod`` masks."""
    records, downlink, scale, clip = fit_inputs(message)
    node, out, finite = train_client(records, downlink, context)
    if not finite:  # the secure sum cannot drop one summand: this client drops out instead
        raise DataError(f"client {node.client}'s update is not finite; it leaves this round")
    n_train = int(node.data.train_sizes[0])
    return fit_reply(message, out, n_train, scale, clip, {"client": node.client})


@client_app.evaluate()
@logged
def evaluate(message: Message, context: Context) -> Message:
    """Evaluate the client's personalized model on its train and test data."""
    records = {k: message.content[k] for k in ("pflego", "task", "ctx")}
    downlink = params_from_record(message.content["downlink"])
    node, state, ctx = client_round(records, downlink, context)
    row = node.evaluate(downlink, state, ctx)
    content = RecordDict(
        {
            "pflego": ConfigRecord({"client": node.client, "row": json.dumps(row)}),
            "metrics": MetricRecord(
                {k: float(v) for k, v in row.items() if k in ("test_acc", "test_loss")}
            ),
        }
    )
    return Message(content, reply_to=message)


# --- server side --------------------------------------------------------------------------------


def secure_settings(run: dict[str, Any]) -> SecureAggregation | None:
    """SecAgg+ settings from the run config, or ``None`` without ``secure-aggregation``."""
    if not run.get("secure-aggregation"):
        return None
    default = SecureAggregation()
    return SecureAggregation(
        clipping_range=float(run.get("secagg-clipping-range", default.clipping_range)),
        quantization_range=int(run.get("secagg-quantization-range", default.quantization_range)),
        threshold=float(run.get("secagg-threshold", default.threshold)),
    )


@server_app.main()
def main(grid: Grid, context: Context) -> None:
    """Run the experiment of the run config on the connected nodes and write its run directory."""
    from pflego.flower.server import FlowerServer

    log.setLevel(logging.INFO)
    if not log.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("pflego %(levelname)s: %(message)s"))
        log.addHandler(handler)
    run = dict(context.run_config)
    config = decode_config(str(run["pflego-config"]))
    out = str(run.get("out", "") or config.out or "")
    FlowerServer(
        config,
        grid,
        RunDir(out) if out else None,
        round_timeout=float(run.get("round-timeout", 120.0)),
        join_timeout=float(run.get("join-timeout", 120.0)),
        input_shape=str(run.get("input-shape", "") or ""),
        label_names=str(run.get("label-names", "") or ""),
        secure=secure_settings(run),
        resume=bool(run.get("resume", False)),
        run_key=str(context.run_id),
    ).run()


__all__ = ["client_app", "server_app"]
