#!/usr/bin/env bash
# Both ports' NEON path, cross-built for AArch64 and run under qemu-user: the C++ unit tests
# (ctest) and the Rust unit tests (cargo test), where every instruction set this build can run
# (neon, scalar) is checked against the plain reference kernel. No Python here: an AArch64
# wheel is built and tested by cibuildwheel on an AArch64 runner (pyproject.toml).
# Needs: apt-get install g++-aarch64-linux-gnu qemu-user; rustup target add aarch64-unknown-linux-gnu
# (installed here when missing: apt-get when run as root, rustup when present).
# Usage: bash scripts/aarch64.sh
set -euo pipefail
cd "$(dirname "$0")/.."
JOBS=${JOBS:-$(nproc 2>/dev/null || echo 2)}
SYSROOT=${AARCH64_SYSROOT:-/usr/aarch64-linux-gnu}

packages=()
command -v aarch64-linux-gnu-g++ >/dev/null || packages+=(g++-aarch64-linux-gnu)
command -v qemu-aarch64 >/dev/null || packages+=(qemu-user)
if [ ${#packages[@]} -gt 0 ] && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${packages[@]}" >/dev/null
fi
if command -v rustup >/dev/null && ! rustup target list --installed 2>/dev/null | grep -qx aarch64-unknown-linux-gnu; then
  rustup target add aarch64-unknown-linux-gnu
fi

missing=()
command -v aarch64-linux-gnu-g++ >/dev/null || missing+=("aarch64-linux-gnu-g++ (apt-get install g++-aarch64-linux-gnu)")
command -v qemu-aarch64 >/dev/null || missing+=("qemu-aarch64 (apt-get install qemu-user)")
rustup target list --installed 2>/dev/null | grep -qx aarch64-unknown-linux-gnu \
  || missing+=("the Rust standard library for AArch64 (rustup target add aarch64-unknown-linux-gnu)")
if [ ${#missing[@]} -gt 0 ]; then
  printf 'aarch64.sh: missing %s\n' "${missing[@]}" >&2
  exit 2
fi

echo "== C++ unit tests, AArch64 under qemu =="
cmake -S cpp -B build/aarch64-cpp -G Ninja -DCMAKE_BUILD_TYPE=Release -DTWINATTN_BUILD_TESTS=ON \
  -DCMAKE_SYSTEM_NAME=Linux -DCMAKE_SYSTEM_PROCESSOR=aarch64 \
  -DCMAKE_C_COMPILER=aarch64-linux-gnu-gcc -DCMAKE_CXX_COMPILER=aarch64-linux-gnu-g++ \
  "-DCMAKE_CROSSCOMPILING_EMULATOR=qemu-aarch64;-L;$SYSROOT" >/dev/null
cmake --build build/aarch64-cpp -j "$JOBS"
ctest --test-dir build/aarch64-cpp --output-on-failure

echo "== Rust unit tests, AArch64 under qemu =="
(cd rust && CARGO_TARGET_DIR=../build/aarch64-rust \
  CARGO_TARGET_AARCH64_UNKNOWN_LINUX_GNU_LINKER=aarch64-linux-gnu-gcc \
  CARGO_TARGET_AARCH64_UNKNOWN_LINUX_GNU_RUNNER="qemu-aarch64 -L $SYSROOT" \
  cargo test --release --locked --target aarch64-unknown-linux-gnu -j "$JOBS")

echo "aarch64.sh: OK"
