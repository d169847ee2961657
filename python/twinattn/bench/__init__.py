"""twinattn.bench: the `twinattn-bench` command (also `python -m twinattn.bench`).

suite.py     the cases (one definition, also used by benchmarks/), their work counts, inputs and checks
timing.py    honest timing: skip rules, check, warm-up, timed calls within a budget; the run of a suite
peers.py     what is timed: twinattn's cpp, rust and numpy backends, and the peers torch and onnxruntime
machine.py   the machine and its ceilings: NumPy float32 GEMM, read bandwidth
report.py    progress, result rows, speedups, the table, JSON and the plot
cli.py       the command line
"""

from .cli import main

__all__ = ["main"]
