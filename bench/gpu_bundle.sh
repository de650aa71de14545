#!/usr/bin/env bash
# Run HERE (a machine with the build dependencies): packs what bench/gpu_check.sh needs on a bare GPU machine that
# cannot install anything: the GPU test and benchmark programs, crosskv-synth, and the shared libraries they use
# that a CUDA image lacks (HDF5, OpenBLAS/LAPACK, yaml-cpp, spdlog, MPI, ...; not libc, libstdc++ or CUDA's own).
#   bench/gpu_bundle.sh            -> .gpu-bundle.tar.xz in the repository root (ignored by git; carry it)
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
BUILD=${BUILD:-$ROOT/build}
cd "$ROOT"
"$BUILD/crosskv-fit" --version | grep -q "cuda: yes" || { echo "gpu_bundle: $BUILD was built without CUDA" >&2; exit 1; }
cmake --build "$BUILD" --target test_cuda crosskv-bench-gpu crosskv-bench-apply crosskv-synth > /dev/null
STAGE=$(mktemp -d)
mkdir -p "$STAGE/bin" "$STAGE/lib"
cp "$BUILD/tests/test_cuda" "$BUILD/bench/crosskv-bench-gpu" "$BUILD/bench/crosskv-bench-apply" \
  "$BUILD/bench/crosskv-bench-eval" "$BUILD/crosskv-synth" \
  "$STAGE/bin/"
for b in "$STAGE"/bin/*; do ldd "$b"; done | awk '/=> \// {print $3}' | sort -u | while read -r lib; do
  case "$lib" in
    */libc.so*|*/libm.so*|*/libdl.so*|*/librt.so*|*/libpthread.so*|*/ld-linux*|*/libstdc++.so*|*/libgcc_s.so*) ;;
    /usr/local/cuda*|*/libcuda.so*) ;;
    *) cp -L "$lib" "$STAGE/lib/" ;;
  esac
done
grep -q '^/.gpu-bundle.tar.xz$' .git/info/exclude 2> /dev/null || echo '/.gpu-bundle.tar.xz' >> .git/info/exclude
tar -C "$STAGE" -cJf .gpu-bundle.tar.xz bin lib
rm -rf "$STAGE"
echo "gpu_bundle: $(du -h .gpu-bundle.tar.xz | cut -f1) in .gpu-bundle.tar.xz ($(tar -tJf .gpu-bundle.tar.xz | grep -c '^lib/.') libraries)"
