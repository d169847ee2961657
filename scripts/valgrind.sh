#!/usr/bin/env bash
# valgrind memcheck over a representative subset of the Python tests, through both native ports.
# valgrind does not emulate AVX-512, so the ports run their AVX2 and scalar paths here (their
# CPU detection sees what valgrind's virtual CPU offers). Any memcheck error fails the run.
# Usage: bash scripts/valgrind.sh [extra pytest args]
set -euo pipefail
cd "$(dirname "$0")/.."

VENV_PY=${VENV_PY:-.venv/bin/python}
[ -x "$VENV_PY" ] || { echo "run scripts/test.sh first (it creates .venv and installs twinattn)"; exit 2; }
command -v valgrind >/dev/null || { echo "valgrind not found (apt-get install valgrind)"; exit 2; }

SUBSET=(
  tests/test_seeds.py
  "tests/test_attention.py::test_per_sequence_offsets_and_lengths"
  "tests/test_attention.py::test_masks"
  "tests/test_attention.py::test_non_contiguous_views"
  "tests/test_invariants.py"
  "tests/test_errors.py::test_native_entry_point_rejects_bad_input"
  "tests/test_isa.py::test_offsets_lengths_masks"
)
# PYTHONMALLOC=malloc lets memcheck see every Python allocation; leaks are not checked (CPython
# keeps its own allocations alive until exit by design).
PYTHONMALLOC=malloc valgrind --tool=memcheck --error-exitcode=99 --leak-check=no \
  --track-origins=no --suppressions=scripts/valgrind-python.supp -q \
  "$VENV_PY" -m pytest "${SUBSET[@]}" -q -p no:cacheprovider -k "not numpy" "$@"
