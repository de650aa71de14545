#!/usr/bin/env bash
# Sets up, builds and runs the whole test suite (GoogleTest, command-line, mpiexec and numpy checks) under ctest.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
"$ROOT/scripts/setup.sh"
cd "$ROOT/build"
ctest --output-on-failure -j"$(nproc)" "$@"
