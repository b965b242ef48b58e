"""Lossless conversion between pflego's tensors and Flower records.

Parameter dicts travel as ``ArrayRecord`` (one ``Array`` per tensor, dtype and shape kept, so a
float32 tensor comes back bit for bit); a ``RoundContext`` travels as a ``ConfigRecord`` of Python
scalars (ints and doubles, exact); a client's ``ClientOut`` as one ``ArrayRecord`` with the
prefixes ``upload.``, ``weight`` and ``metrics.``. The experiment config travels in the run config
as base64-encoded JSON, which survives Flower's TOML-based ``--run-config`` parsing unchanged.
"""

from __future__ import annotations

import base64
import dataclasses
import json
from collections.abc import Mapping

import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, MetricRecord, RecordDict
from torch import Tensor

from pflego.config import Config, load_config, to_dict
from pflego.tree import Params
from pflego.types import ClientOut, RoundContext


def params_to_record(params: Mapping[str, Tensor], prefix: str = "") -> ArrayRecord:
    """A parameter (or state) dict as an ``ArrayRecord``; keys get ``prefix`` prepended."""
    record = ArrayRecord()
    for key, value in params.items():
        record[prefix + key] = Array.from_torch_tensor(value.detach().cpu().contiguous())
    return record


def params_from_record(record: ArrayRecord, prefix: str = "") -> Params:
    """The tensors of ``record`` whose keys start with ``prefix`` (stripped), as a dict."""
    return {
        key[len(prefix) :]: torch.from_numpy(array.numpy().copy())
        for key, array in record.items()
        if key.startswith(prefix)
    }


def client_out_to_record(out: ClientOut) -> ArrayRecord:
    """A client's upload, weight and metrics as one ``ArrayRecord``."""
    record = params_to_record(out.upload, "upload.")
    record["weight"] = Array.from_torch_tensor(torch.as_tensor(out.weight).detach().cpu())
    for key, value in out.metrics.items():
        record["metrics." + key] = Array.from_torch_tensor(torch.as_tensor(value).detach().cpu())
    return record


def client_out_from_record(record: ArrayRecord) -> ClientOut:
    """Inverse of :func:`client_out_to_record`."""
    weight = torch.from_numpy(record["weight"].numpy().copy())
    return ClientOut(
        params_from_record(record, "upload."), weight, params_from_record(record, "metrics.")
    )


def context_to_record(ctx: RoundContext) -> ConfigRecord:
    """A ``RoundContext`` as a ``ConfigRecord`` (every field a Python int or float)."""
    return ConfigRecord(dataclasses.asdict(ctx))


def context_from_record(record: ConfigRecord) -> RoundContext:
    """Inverse of :func:`context_to_record`."""
    return RoundContext(**{f.name: record[f.name] for f in dataclasses.fields(RoundContext)})


def encode_config(config: Config) -> str:
    """A config as one ASCII string (base64 of its JSON) for Flower's run config."""
    return base64.urlsafe_b64encode(json.dumps(to_dict(config)).encode()).decode("ascii")


def decode_config(text: str) -> Config:
    """Inverse of :func:`encode_config`, validated; an empty string gives the defaults."""
    if not text:
        return load_config(None)
    return load_config(json.loads(base64.urlsafe_b64decode(text.encode("ascii"))))


def payload_bytes(content: RecordDict) -> int:
    """About how many bytes a message's content carries: its arrays' serialized bytes, plus
    8 per metric and the text of config values (what the status line reports)."""
    total = 0
    for record in content.values():
        if isinstance(record, ArrayRecord):
            total += sum(len(array.data) for array in record.values())
        elif isinstance(record, MetricRecord):
            total += 8 * len(record)
        else:
            total += sum(len(str(v)) for v in record.values())
    return total
