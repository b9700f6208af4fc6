"""`python -m benchmarks [--quick] [--out DIR]`: run all benchmarks (see run_all.py)."""

from .run_all import main

main()
