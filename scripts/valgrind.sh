#!/usr/bin/env bash
# valgrind memcheck over a representative subset of the Python tests, through both native ports.
# valgrind does not emulate AVX-512, so the ports run their AVX2 and scalar paths here (their
# CPU detection sees what valgrind's virtual CPU offers). Any memcheck error fails the run.
# Installs what it needs: twinattn with its test extra into .venv (built as the test command builds
# it, reusing its build folder), and valgrind (apt-get, when run as root) if it is missing.
# Usage: bash scripts/valgrind.sh [extra pytest args]
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/_env.sh

if ! command -v valgrind >/dev/null; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq valgrind >/dev/null
  else
    echo "valgrind not found: install it (e.g. sudo apt-get install valgrind)"; exit 2
  fi
fi
install_twinattn test

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
