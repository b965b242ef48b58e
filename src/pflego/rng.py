"""The run's random streams, each seeded by integer keys such as (seed, round, client).

Every stream of a run derives from its one seed here, so the simulator's backends, Flower nodes
and resumed runs draw the same numbers.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor


def seed_for(*keys: int) -> int:
    """A 63-bit seed derived from integer keys, e.g. (seed, round, client)."""
    return int(
        np.random.SeedSequence([int(k) for k in keys]).generate_state(2, np.uint64)[0]
        >> np.uint64(1)
    )


def first_visit_generator(seed: int, client: int) -> torch.Generator:
    """The generator of a client's first-visit state: the same in every backend and on Flower."""
    return torch.Generator().manual_seed(seed_for(seed, 3, client))


def minibatch_rng(seed: int, round_: int, client: int, stream: int = 0) -> np.random.Generator:
    """The generator that shuffles a client's minibatches in a round.

    ``stream`` 0 is the run's schedule; the algorithm's extra named schedules use 1, 2, ... in
    the order of their sorted names.
    """
    keys = (seed, 2, round_, client) + ((stream,) if stream else ())
    return np.random.default_rng(seed_for(*keys))


def adapt_rng(seed: int, round_: int, client: int, stream: int = 0) -> np.random.Generator:
    """The generator of a client's ``adapt`` / ``join`` batches at the evaluation after ``round_``."""
    keys = (seed, 4, round_, client) + ((stream,) if stream else ())
    return np.random.default_rng(seed_for(*keys))


_MASK32 = 0xFFFFFFFF


def _hash32(h: Tensor) -> Tensor:
    """A 32-bit integer hash (three xor-shift-multiply rounds) of int64 values below 2^32."""
    for _ in range(3):
        h = (((h >> 16) ^ h) * 0x45D9F3B) & _MASK32
    return (h >> 16) ^ h


def counter_bits(key: Tensor, *counters: Tensor) -> Tensor:
    """32 random bits (int64 in ``[0, 2^32)``) per entry of the broadcast ``counters`` (int64
    tensors), hashed from the integer ``key``: a counter-based generator, a pure function of its
    arguments, so the same (key, counters) give the same bits in every backend, under
    ``torch.func.vmap`` and on Flower (where a ``torch.Generator`` cannot be used)."""
    h = _hash32(key.to(torch.int64) & _MASK32)
    for c in counters:
        h = _hash32(h ^ (c.to(torch.int64) & _MASK32))
    return h


def counter_uniform(key: Tensor, *counters: Tensor, dtype: torch.dtype = torch.float64) -> Tensor:
    """Uniform draws in (0, 1), one per entry of the broadcast ``counters``, from
    :func:`counter_bits`."""
    return (counter_bits(key, *counters).to(dtype) + 0.5) / 2**32


def counter_normal(key: Tensor, *counters: Tensor, dtype: torch.dtype = torch.float64) -> Tensor:
    """Standard normal draws, one per entry of the broadcast ``counters``, from
    :func:`counter_bits` (Box-Muller on two uniforms hashed from them)."""
    h = counter_bits(key, *counters)
    u1 = (_hash32(h ^ 0x1B873593).to(dtype) + 0.5) / 2**32
    u2 = (_hash32(h ^ 0x68E31DA4).to(dtype) + 0.5) / 2**32
    return torch.sqrt(-2 * torch.log(u1)) * torch.cos(2 * torch.pi * u2)


def next_key(key: Tensor) -> Tensor:
    """The key of a client's next round of counter-based draws (24 bits hashed from ``key``,
    exact in a float32 client state)."""
    return (counter_bits(key) >> 8).to(key.dtype)
