"""twinattn.bench: the `twinattn-bench` command (also `python -m twinattn.bench`).

cases.py     the standard suite, exact work counts (visible query-key pairs), inputs, checks
runners.py   the backends timed: cpp, rust, numpy, and the peers torch and onnxruntime
measure.py   honest timing: skip rules, check, warm-up, timed calls within a budget
machine.py   the machine and its ceilings: NumPy float32 GEMM, read bandwidth
report.py    speedups, the table, JSON and the plot
cli.py       the command line
"""

from .cli import main

__all__ = ["main"]
