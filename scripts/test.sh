#!/usr/bin/env bash
# The test command: installs twinattn with its test extras into .venv (both native ports built
# from source, build folders reused), type-checks the package and the native stubs (mypy, stubtest), then runs the Python tests
# on every backend, the C++ unit tests (ctest), the Rust unit tests (cargo test) and the Rust
# lints (rustfmt, clippy).
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
JOBS=${JOBS:-$(nproc 2>/dev/null || echo 2)}
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
VENV_PY=.venv/bin/python

echo "== install (pip install .[test]) =="
"$VENV_PY" -m pip install --quiet --upgrade pip
CMAKE_BUILD_PARALLEL_LEVEL=$JOBS CARGO_BUILD_JOBS=$JOBS \
  "$VENV_PY" -m pip install --quiet ".[test]"

echo "== type checks (mypy --strict on the package, stubtest on the native modules' stubs) =="
# [tool.mypy] in pyproject.toml: python/twinattn under --strict
"$VENV_PY" -m mypy
# the installed _cpp and _rust against python/twinattn/_cpp.pyi and _rust.pyi (names, and for PyO3
# the full signatures; pybind11 functions carry no __text_signature__, so only their names)
"$VENV_PY" -m mypy.stubtest twinattn._cpp twinattn._rust

echo "== C++ unit tests (ctest) =="
cmake -S cpp -B build/cpp-tests -G Ninja -DCMAKE_BUILD_TYPE=Release -DTWINATTN_BUILD_TESTS=ON >/dev/null
cmake --build build/cpp-tests -j "$JOBS"
ctest --test-dir build/cpp-tests --output-on-failure

echo "== Rust unit tests (cargo test) =="
(cd rust && CARGO_TARGET_DIR=../build/cargo-tests cargo test --release --locked -j "$JOBS")

echo "== Rust lints (cargo fmt --check, cargo clippy -D warnings, with and without the binding) =="
if cargo clippy --version >/dev/null 2>&1 && cargo fmt --version >/dev/null 2>&1; then
  (cd rust && cargo fmt --check \
    && CARGO_TARGET_DIR=../build/cargo-tests cargo clippy --release --locked --all-targets -j "$JOBS" -- -D warnings \
    && PYO3_PYTHON="$(cd .. && pwd)/$VENV_PY" CARGO_TARGET_DIR=../build/cargo-tests \
       cargo clippy --release --locked --features python -j "$JOBS" -- -D warnings)
else
  echo "skipped: this Rust toolchain has no clippy / rustfmt (rustup component add clippy rustfmt)"
fi

echo "== Python tests (pytest, every backend) =="
# a port that failed to build must fail the run, not be skipped
TWINATTN_REQUIRE_BACKENDS=cpp,rust "$VENV_PY" -m pytest "$@"
