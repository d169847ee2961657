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
match = re.search(r"^%s\s*=\s*\[(.*)\]\s*(#.*)?$" % re.escape(sys.argv[1]), text, re.M)
if not match:
    sys.exit(f"pyproject.toml: no one-line list {sys.argv[1]!r}")
print(" ".join(re.findall(r'"([^"]+)"', match.group(1))))
PY
}

ensure_venv() {
  if [ ! -x "$VENV_PY" ]; then
    step "creating the virtual environment $(dirname "$(dirname "$VENV_PY")")"
    "${PYTHON:-python3}" -m venv "$(dirname "$(dirname "$VENV_PY")")"
    "$VENV_PY" -m pip install --quiet --upgrade pip
    step_done
  fi
}

# A line as a step of an install starts ("  - what ..."), and its duration as it ends.
step() {
  STEP_START=$SECONDS
  echo "  - $1"
}
step_done() {
  echo "    done in $((SECONDS - STEP_START)) s"
}

# The lines of pip -v's output that say how an install is going: what pip downloads and builds, and
# the build's own steps (ninja's "[n/N] ..." and cargo's "Compiling ..." / "Finished ...")
PROGRESS_LINES='^(Collecting|Downloading|Building wheel|Created wheel|Installing collected|Successfully installed)|^ *\[[0-9]+/[0-9]+\] |^ *(Compiling|Finished) '

# Runs a command, showing only the lines of its output that match PROGRESS_LINES, as they come; the
# whole output goes to the log file $1, whose last lines are shown if the command fails.
run_showing_progress() {
  local log=$1 status
  shift
  mkdir -p "$(dirname "$log")"
  { "$@" 2>&1 && echo 0 >"$log.status" || echo $? >"$log.status"; } | tee "$log" \
    | { grep --line-buffered -E "$PROGRESS_LINES" | sed -u 's/^ */    /' || true; }
  status=$(cat "$log.status")
  rm -f "$log.status"
  if [ "$status" != 0 ]; then
    echo "failed (exit status $status); the end of its output (all of it: $log):"
    tail -n 60 "$log"
    return "$status"
  fi
}

# Builds and installs twinattn (both ports) with the given extras into .venv. The build
# requirements go into .venv and pip builds without an isolated environment: nothing is fetched
# per run, and CMake hands cargo the same interpreter path every time, so cargo's build is reused.
install_twinattn() {
  ensure_venv
  step "the build requirements: $(pyproject_list requires)"
  # shellcheck disable=SC2046  # the lists are whitespace-separated requirement specifiers
  "$VENV_PY" -m pip install --quiet $(pyproject_list requires)
  # and what the backend asks for on top (cmake and ninja from PyPI where the system has none)
  local extra
  extra=$("$VENV_PY" -c 'from scikit_build_core.build import get_requires_for_build_wheel as r; print(" ".join(r()))')
  # shellcheck disable=SC2086
  [ -z "$extra" ] || "$VENV_PY" -m pip install --quiet $extra
  step_done
  # The dependencies install while the ports build: pip unpacking wheels (torch's are several GB)
  # waits mostly on the disk, the build on the compilers, so together they take about as long as
  # the build alone. The two pips touch different packages: twinattn's own goes in with --no-deps.
  local requirements deps_log=$WHEEL_BUILD/pip-dependencies.log deps_pid
  requirements=$(extras_requirements "$1")
  step "twinattn[$1]'s dependencies, in the background: $requirements"
  mkdir -p "$WHEEL_BUILD"
  # shellcheck disable=SC2086  # a whitespace-separated list of requirement specifiers
  "$VENV_PY" -m pip install --quiet $requirements >"$deps_log" 2>&1 &
  deps_pid=$!
  step "twinattn, both native ports built in $WHEEL_BUILD (a few minutes the first time, reused after)"
  # -v for the build's own progress lines, of which run_showing_progress shows the steps
  if ! CMAKE_BUILD_PARALLEL_LEVEL=$JOBS CARGO_BUILD_JOBS=$JOBS run_showing_progress "$WHEEL_BUILD/pip-install.log" \
    "$VENV_PY" -m pip install -v --no-deps --no-build-isolation --config-settings=build-dir="$WHEEL_BUILD" \
    --config-settings=cmake.define.TWINATTN_BUILD_TESTS=ON "."; then
    kill "$deps_pid" 2>/dev/null || true
    return 1
  fi
  step_done
  step "the dependencies, finishing"
  if ! wait "$deps_pid"; then
    echo "failed: pip install $requirements; the end of its output (all of it: $deps_log):"
    tail -n 60 "$deps_log"
    return 1
  fi
  step_done
}

# The requirements of twinattn's dependencies and of the given extras (comma-separated), an
# extra's reference to another of twinattn's extras (hf's twinattn[torch]) expanded in place.
extras_requirements() {
  local todo=${1//,/ } seen=" " requirements extra requirement own
  requirements=$(pyproject_list dependencies)
  while read -r extra todo <<<"$todo" && [ -n "$extra" ]; do
    case "$seen" in *" $extra "*) continue ;; esac
    seen="$seen$extra "
    for requirement in $(pyproject_list "$extra"); do
      case "$requirement" in
        "twinattn["*"]")
          own=${requirement#twinattn[}
          own=${own%]}
          todo="$todo ${own//,/ }" ;;
        *) requirements="$requirements $requirement" ;;
      esac
    done
  done
  echo "$requirements"
}

# The environment CMakeLists.txt gives cargo for the wheel build (same target folder, same
# interpreter, extension-module linking): cargo run with it reuses that build's artifacts.
cargo_env_of_wheel_build() {
  CARGO_TARGET_DIR=$ROOT/$WHEEL_BUILD/cargo
  PYO3_PYTHON=$(sed -n 's/^Python_EXECUTABLE:[A-Z]*=//p' "$WHEEL_BUILD/CMakeCache.txt")
  PYO3_BUILD_EXTENSION_MODULE=1
  export CARGO_TARGET_DIR PYO3_PYTHON PYO3_BUILD_EXTENSION_MODULE
}
