"""Checks of plain arguments (flags, numbers, optimizers), shared by the public functions.

A flag is read with `if flag:`, so a string such as `"no"` would quietly mean yes (and
`merge_params(destructive="no")` would delete the caller's weights); a `nan` scale
would train on `nan`s; an optimizer given by name fails deep inside optax. Each check
raises at the call, naming the function and argument. Checks of lorax's own values
live with them (a spec value's against its weight: `_spec.check_weight_spec`).
"""

from __future__ import annotations

import math
from typing import Any

import jax
import numpy as np
import optax


def is_int(x: Any) -> bool:
    """An integer, Python's or NumPy's (JAX's scalar types are NumPy's), and not a bool."""
    return isinstance(x, (int, np.integer)) and not isinstance(x, (bool, np.bool_))


def check_bool(where: str, name: str, value: Any) -> bool:
    """`value` if it is a bool (Python's or NumPy's), else a `TypeError`."""
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{where}: {name} must be True or False, got {value!r}.")
    return bool(value)


def check_finite(where: str, name: str, value: Any, *, positive: bool = False) -> Any:
    """`value` as a float if it is a finite real number (`> 0` with `positive`), else
    a `TypeError` (not a number) or `ValueError` (`nan`, `inf`, not positive)."""
    if isinstance(value, jax.core.Tracer):
        return value  # a traced scale: its value is not known here
    real = isinstance(value, (int, float, np.integer, np.floating)) or (
        getattr(value, "shape", None) == () and np.issubdtype(value.dtype, np.number)
        and not np.issubdtype(value.dtype, np.complexfloating))
    if isinstance(value, (bool, np.bool_)) or not real:
        raise TypeError(f"{where}: {name} must be a real number, got {value!r}.")
    out = float(value)
    if not math.isfinite(out) or (positive and out <= 0):
        need = "a finite number > 0" if positive else "a finite number"
        raise ValueError(f"{where}: {name} must be {need}, got {value!r}.")
    return out


def check_optimizer(name: str, optimizer: Any) -> None:
    """Raise a `TypeError` naming `name` unless `optimizer` is an optax transformation
    (anything with `init` and `update`, as optax's own protocol has it)."""
    if callable(getattr(optimizer, "init", None)) and callable(getattr(optimizer, "update", None)):
        return
    hint = (f" (`optax.{optimizer}(learning_rate)` makes one)"
            if isinstance(optimizer, str) and callable(getattr(optax, optimizer, None)) else "")
    raise TypeError(f"{name}: optimizer must be an optax.GradientTransformation (with init "
                    f"and update), e.g. optax.adam(1e-3); got {type(optimizer).__name__} "
                    f"{optimizer!r:.60}{hint}")
