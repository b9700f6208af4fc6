"""Checks of plain arguments (flags, numbers), shared by the public functions.

A flag is read with `if flag:`, so a string such as `"no"` would quietly mean yes (and
`merge_params(destructive="no")` would delete the caller's weights); a `nan` scale
would train on `nan`s. Each check raises at the call, naming the function and argument.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import numpy as np


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
