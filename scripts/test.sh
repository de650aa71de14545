#!/usr/bin/env bash
# The test command, the same here and in CI (.ci/run only calls it): installs everything the tests need (Slurm,
# munge, clang and redis-server included: scripts/setup.sh), builds, and runs the whole suite under ctest, whose first
# tests make the Python environments.
#   scripts/test.sh [CTEST ARGS...]     e.g. scripts/test.sh -R emulated
#   scripts/test.sh --quick             on a built tree, for a developer between changes: the build brought up to
#                                       date, then every test but the slow ones (about 2 minutes on 2 cores; the
#                                       Python, vLLM, Slurm, fuzz and long command-line runs are left to the full run)
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
if [ "${1:-}" = --quick ]; then
  shift
  [ -f "$ROOT/build/build.ninja" ] || { echo "scripts/test.sh --quick runs on a built tree: run scripts/test.sh first" >&2; exit 2; }
  t0=$(date +%s)
  cmake --build "$ROOT/build" -j"$(nproc)" | grep -vE '^\[[0-9]+/[0-9]+\] (Building|Linking)' || true
  SLOW='^(setup\.|python\.|slurm\.|fuzz\.)|^(mpi\.grid_np4|cli\.checkpoint_resume|cli\.mlp_resume|cli\.apply_eval|emulated\.cli_cuda_fits|emulated\.planted_bugs_are_caught)$'
  cd "$ROOT/build"
  ctest --output-on-failure -j"$(nproc)" -E "$SLOW" "$@"
  echo "[test] --quick: $(( $(date +%s) - t0 )) s (the slow tests: scripts/test.sh -R '$SLOW')"
  exit 0
fi
# The build first; the Python environments are ctest's first tests (setup.*_environment), made on one core
# while the C++ tests run on the other.
"$ROOT/scripts/setup.sh" --build
cd "$ROOT/build"
t0=$(date +%s)
ctest --output-on-failure -j"$(nproc)" "$@"
echo "[test] ctest: $(( $(date +%s) - t0 )) s"
