"""Factor shardings derived from the frozen weight's, so LoRA adds no unexpected communication.

`b: (*batch, *M, k)` follows `W`'s sharding on its batch and `M` axes, `a: (*batch, k, *N)`
on its batch and `N` axes; the rank axis is replicated unless a mesh axis is named
for it. With a tensor-parallel `W` (column- or row-sharded) the low-rank path then
needs at most one small all-reduce of the `(tokens, k)` intermediate, and an
FSDP-sharded `W` gets FSDP-sharded factors.
"""

from __future__ import annotations

from typing import Any

import jax
from jax.sharding import NamedSharding, PartitionSpec


def factor_shardings(
    w: Any, n_batch: int, n_m: int, rank_axis: str | None = None
) -> tuple[Any, Any] | None:
    """`(a_sharding, b_sharding)` for a weight, or `None` if `w` is not `NamedSharding`-sharded."""
    sharding = getattr(w, "sharding", None)
    if not isinstance(sharding, NamedSharding):
        return None
    spec = tuple(sharding.spec) + (None,) * (w.ndim - len(sharding.spec))
    batch, m, n = spec[:n_batch], spec[n_batch : n_batch + n_m], spec[n_batch + n_m :]
    b_spec = PartitionSpec(*batch, *m, rank_axis)
    a_spec = PartitionSpec(*batch, rank_axis, *n)
    return NamedSharding(sharding.mesh, a_spec), NamedSharding(sharding.mesh, b_spec)


def place_factors(w: Any, a: Any, b: Any, n_batch: int, n_m: int,
                  rank_axis: str | None = None) -> tuple[Any, Any]:
    """`a` and `b` moved onto the shardings derived from `w`'s (unchanged if it has none)."""
    shardings = factor_shardings(w, n_batch, n_m, rank_axis)
    if shardings is None:
        return a, b
    return jax.device_put(a, shardings[0]), jax.device_put(b, shardings[1])
