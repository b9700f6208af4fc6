"""Shared test set-up: hypothesis profiles and helpers for comparing with the dense reference."""

from __future__ import annotations

import os

# XLA reads its flags when JAX first initialises its backend, so they are set before
# anything can: eight simulated CPU devices and LLVM at -O0 (tests/xla_flags.py says why).
from xla_flags import session_flags

os.environ["XLA_FLAGS"] = session_flags(os.environ.get("XLA_FLAGS", ""))
# llama.cpp's threads spin-wait: beside a second worker on two cores, one thread runs the
# llama.cpp checks two to three times faster than two (examples/shakespeare/llamacpp.py).
os.environ.setdefault("LLAMACPP_THREADS", "1")

import jax  # noqa: E402
import numpy as np  # noqa: E402
from hypothesis import HealthCheck, settings  # noqa: E402

jax.config.update("jax_enable_x64", False)

# `ci` keeps the default suite within CI's budget on 2 cores (5 examples a property,
# the same ones every run); `dev` (the default) and `thorough` are for local runs
# (HYPOTHESIS_PROFILE=thorough). Tracing dominates each example, so
# deadlines are off: wall-clock is not what these tests check.
settings.register_profile(
    "ci", max_examples=5, deadline=None, derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.register_profile(
    "dev", max_examples=40, deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.register_profile(
    "thorough", max_examples=400, deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "dev"))


def assert_close(actual, expected, dtype=np.float32, scale=1.0, *, rtol=None, atol=None, err_msg=""):
    """Compare values computed two ways (low-rank vs merged, jit vs eager, sharded vs one
    device: any other op sequence or reduction order) with a tolerance that suits `dtype`
    and the magnitude of `expected`.

    The absolute tolerance is `atol` times the largest |expected| (at least 1, times
    `scale`): an element that cancels to ~0 keeps the rounding error of the terms it was
    summed from, so numpy's default atol=0 fails it on a reordered sum. `rtol` defaults
    to 4x the dtype's tolerance and `atol` to `rtol`. Claims of bit-identity use
    `np.testing.assert_array_equal` instead."""
    actual = np.asarray(actual, np.float32)
    expected = np.asarray(expected, np.float32)
    tol = {np.dtype("float32"): 2e-5, np.dtype(jax.numpy.bfloat16): 2e-2}[np.dtype(dtype)]
    rtol = tol * 4 if rtol is None else rtol
    atol = rtol if atol is None else atol
    mag = max(1.0, float(np.abs(expected).max(initial=0.0))) * scale
    np.testing.assert_allclose(actual, expected, rtol=rtol, atol=atol * mag, err_msg=err_msg)
