"""lorax benchmarks: training-step speed, compiled memory, trace time (`python -m benchmarks`)."""
