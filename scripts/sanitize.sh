#!/usr/bin/env bash
# The C++ port under AddressSanitizer + UndefinedBehaviorSanitizer:
#   1. the C++ unit tests (ctest), built with -fsanitize=address,undefined;
#   2. the Python test suite through a sanitized twinattn._cpp (libasan preloaded into Python).
# Any report fails the run (halt_on_error). Usage: bash scripts/sanitize.sh [extra pytest args]
# Installs what it needs into .venv (created if missing): pybind11 (the module's build), numpy and
# the test extra (the Python half runs the package from the source tree, not an installed wheel).
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/_env.sh

ensure_venv
# shellcheck disable=SC2046  # whitespace-separated requirement specifiers from pyproject.toml
"$VENV_PY" -m pip install --quiet $(pyproject_list requires) $(pyproject_list dependencies) $(pyproject_list test)
SAN_FLAGS="-fsanitize=address,undefined -fno-sanitize-recover=all -fno-omit-frame-pointer -g"
export ASAN_OPTIONS="halt_on_error=1:detect_leaks=0:abort_on_error=1"
export UBSAN_OPTIONS="halt_on_error=1:print_stacktrace=1"

echo "== C++ unit tests under ASan + UBSan =="
cmake -S cpp -B build/asan-tests -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DTWINATTN_BUILD_TESTS=ON \
  -DCMAKE_CXX_FLAGS="$SAN_FLAGS" -DCMAKE_EXE_LINKER_FLAGS="-fsanitize=address,undefined" >/dev/null
cmake --build build/asan-tests -j "$JOBS"
ctest --test-dir build/asan-tests --output-on-failure

echo "== Python tests through a sanitized twinattn._cpp =="
cmake -S . -B build/asan-py -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DTWINATTN_RUST=OFF \
  -DSKBUILD_PROJECT_VERSION="$("$VENV_PY" -c 'import re;print(re.search(r"\"(.+)\"", open("python/twinattn/_version.py").read()).group(1))')" \
  -DPython_EXECUTABLE="$VENV_PY" -Dpybind11_DIR="$("$VENV_PY" -m pybind11 --cmakedir)" \
  -DCMAKE_CXX_FLAGS="$SAN_FLAGS" -DCMAKE_SHARED_LINKER_FLAGS="-fsanitize=address,undefined" >/dev/null
cmake --build build/asan-py -j "$JOBS" --target _cpp
overlay=build/asan-py/overlay
rm -rf "$overlay" && mkdir -p "$overlay"
cp -r python/twinattn "$overlay/"
cp build/asan-py/_cpp*.so "$overlay/twinattn/"
LIBASAN=$(g++ -print-file-name=libasan.so)
LIBUBSAN=$(g++ -print-file-name=libubsan.so)
# Python itself is not instrumented: preload the runtimes so the module's checks work.
PYTHONPATH="$overlay" LD_PRELOAD="$LIBASAN:$LIBUBSAN" PYTHONMALLOC=malloc \
  "$VENV_PY" -m pytest tests -q -p no:cacheprovider -k "not rust" \
  --ignore=tests/test_bench.py --ignore=tests/test_llama_parity.py "$@"
