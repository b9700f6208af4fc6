"""The XLA flags of the test session (tests/conftest.py sets them before JAX starts) and
the environments of the processes tests start.

- Eight simulated CPU devices, for the sharding tests; single-device code still runs on
  device 0 alone.
- LLVM at -O0. The tests check what lorax traces and what XLA's HLO passes make of it:
  values within a tolerance, jaxpr and HLO structure, buffer assignment
  (`memory_analysis`), collectives. The machine-code optimiser changes none of these
  (the compiled HLO text and the memory figures are identical at -O0 and -O3); it only
  makes kernels faster. Most tests run tiny programs once, where compiling is most of
  the time, and compiling at -O0 takes about a third less. A test that runs a real model
  for longer starts its process with `env(optimize=True)`.
A flag already in `XLA_FLAGS` is left as the user set it.
"""

from __future__ import annotations

import os

DEVICES = "--xla_force_host_platform_device_count"
OPT_LEVEL = "--xla_backend_optimization_level"


def session_flags(flags: str) -> str:
    """`flags` with the test session's two settings added where the user set none."""
    for name, value in ((DEVICES, 8), (OPT_LEVEL, 0)):
        if name not in flags:
            flags = f"{flags} {name}={value}".strip()
    return flags


def env(optimize: bool = False, **extra: str) -> dict[str, str]:
    """The environment for a child process: the session's, with `extra` added, without
    the simulated devices (a user's run has one device; an example that wants more sets
    its own) and, with `optimize`, without any optimisation level (XLA's default, even
    where the user had set one for the session)."""
    drop = (DEVICES, OPT_LEVEL) if optimize else (DEVICES,)
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if not f.startswith(drop)]
    out = {**os.environ, **extra, "XLA_FLAGS": " ".join(flags)}
    if not out["XLA_FLAGS"]:
        del out["XLA_FLAGS"]
    return out
