# Sourced by the scripts in this folder (not run on its own): the project's .venv and what the
# scripts install into it. Each script that checks the project installs what it needs itself.
#   VENV_PY        the virtual environment's python (created from $PYTHON, default python3)
#   WHEEL_BUILD    the wheel build's folder: CMake builds the C++ unit tests there too, and cargo
#                  keeps its target folder in it (CMakeLists.txt: ${CMAKE_BINARY_DIR}/cargo), so
#                  ctest, cargo test and clippy reuse what `pip install` compiled
ROOT=$(pwd)
JOBS=${JOBS:-$(nproc 2>/dev/null || echo 2)}
VENV_PY=${VENV_PY:-$ROOT/.venv/bin/python}
WHEEL_BUILD=build/test

# The quoted strings of a one-line list `name = [...]` in pyproject.toml (the first such line):
# pyproject_list requires -> the build requirements; dependencies; test -> the test extra.
pyproject_list() {
  "$VENV_PY" - "$1" <<'PY'
import re, sys
text = open("pyproject.toml").read()
match = re.search(r"^%s\s*=\s*\[([^\]]*)\]" % re.escape(sys.argv[1]), text, re.M)
if not match:
    sys.exit(f"pyproject.toml: no one-line list {sys.argv[1]!r}")
print(" ".join(re.findall(r'"([^"]+)"', match.group(1))))
PY
}

ensure_venv() {
  if [ ! -x "$VENV_PY" ]; then
    "${PYTHON:-python3}" -m venv "$(dirname "$(dirname "$VENV_PY")")"
    "$VENV_PY" -m pip install --quiet --upgrade pip
  fi
}

# Builds and installs twinattn (both ports) with the given extras into .venv. The build
# requirements go into .venv and pip builds without an isolated environment: nothing is fetched
# per run, and CMake hands cargo the same interpreter path every time, so cargo's build is reused.
install_twinattn() {
  ensure_venv
  # shellcheck disable=SC2046  # the lists are whitespace-separated requirement specifiers
  "$VENV_PY" -m pip install --quiet $(pyproject_list requires)
  # and what the backend asks for on top (cmake and ninja from PyPI where the system has none)
  local extra
  extra=$("$VENV_PY" -c 'from scikit_build_core.build import get_requires_for_build_wheel as r; print(" ".join(r()))')
  # shellcheck disable=SC2086
  [ -z "$extra" ] || "$VENV_PY" -m pip install --quiet $extra
  CMAKE_BUILD_PARALLEL_LEVEL=$JOBS CARGO_BUILD_JOBS=$JOBS "$VENV_PY" -m pip install --quiet \
    --no-build-isolation --config-settings=build-dir="$WHEEL_BUILD" \
    --config-settings=cmake.define.TWINATTN_BUILD_TESTS=ON ".[$1]"
}

# The environment CMakeLists.txt gives cargo for the wheel build (same target folder, same
# interpreter, extension-module linking): cargo run with it reuses that build's artifacts.
cargo_env_of_wheel_build() {
  CARGO_TARGET_DIR=$ROOT/$WHEEL_BUILD/cargo
  PYO3_PYTHON=$(sed -n 's/^Python_EXECUTABLE:[A-Z]*=//p' "$WHEEL_BUILD/CMakeCache.txt")
  PYO3_BUILD_EXTENSION_MODULE=1
  export CARGO_TARGET_DIR PYO3_PYTHON PYO3_BUILD_EXTENSION_MODULE
}
