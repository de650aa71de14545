#!/usr/bin/env bash
# Run HERE (a machine with the build dependencies): packs what bench/gpu_check.sh needs on a bare GPU machine that
# cannot install anything: the GPU test and benchmark programs, crosskv-synth, -fit and -apply, the Python package
# built with CUDA for Python 3.12, and the shared libraries they use that a CUDA image lacks (HDF5, OpenBLAS/LAPACK,
# yaml-cpp, spdlog, MPI, ...; not libc, libstdc++ or CUDA's own).
#   bench/gpu_bundle.sh            -> .gpu-bundle.tar.xz in the repository root (ignored by git; carry it)
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
BUILD=${BUILD:-$ROOT/build}
cd "$ROOT"
"$BUILD/crosskv-fit" --version | grep -q "cuda: yes" || { echo "gpu_bundle: $BUILD was built without CUDA" >&2; exit 1; }
cmake --build "$BUILD" --target test_cuda crosskv-bench-gpu crosskv-bench-apply crosskv-bench-eval crosskv-synth \
  crosskv-fit crosskv-apply > /dev/null
STAGE=$(mktemp -d)
mkdir -p "$STAGE/bin" "$STAGE/lib"
cp "$BUILD/tests/test_cuda" "$BUILD/bench/crosskv-bench-gpu" "$BUILD/bench/crosskv-bench-apply" \
  "$BUILD/bench/crosskv-bench-eval" "$BUILD/crosskv-synth" "$BUILD/crosskv-fit" "$BUILD/crosskv-apply" \
  "$STAGE/bin/"
# The Python package built with CUDA for the GPU machine's Python (3.12, the one that holds PyTorch there), under
# python/ (PYTHONPATH): from a Python 3.12 here (pyenv's; PY312 names another), in a venv of its own.
PY312=${PY312:-$(ls -d /root/.pyenv/versions/3.12*/bin/python 2> /dev/null | tail -1)}
if [ -n "$PY312" ] && [ -x "$PY312" ]; then
  V=$BUILD/py312-venv
  [ -x "$V/bin/python" ] || { "$PY312" -m venv "$V" && "$V/bin/pip" install -q nanobind scikit-build-core; }
  "$V/bin/pip" wheel -q --no-deps --no-build-isolation -w "$STAGE/wheel" "$ROOT" -C cmake.define.CROSSKV_CUDA=ON \
    -C build-dir="$BUILD/python-cuda-cp312" > "$STAGE/wheel.log" 2>&1 || { tail -20 "$STAGE/wheel.log"; exit 1; }
  mkdir -p "$STAGE/python"
  (cd "$STAGE/python" && "$V/bin/python" -m zipfile -e "$STAGE"/wheel/*.whl .)
  rm -rf "$STAGE/wheel" "$STAGE/wheel.log" "$STAGE"/python/*.dist-info
else
  echo "gpu_bundle: no Python 3.12 here (PY312): the bundle has no Python package" >&2
fi
for b in "$STAGE"/bin/* "$STAGE"/python/crosskv/*.so; do if [ -e "$b" ]; then ldd "$b"; fi; done | awk '/=> \// {print $3}' |
  sort -u | while read -r lib; do
  case "$lib" in
    */libc.so*|*/libm.so*|*/libdl.so*|*/librt.so*|*/libpthread.so*|*/ld-linux*|*/libstdc++.so*|*/libgcc_s.so*) ;;
    /usr/local/cuda*|*/libcuda.so*) ;;
    *) cp -L "$lib" "$STAGE/lib/" ;;
  esac
done
grep -q '^/.gpu-bundle.tar.xz$' .git/info/exclude 2> /dev/null || echo '/.gpu-bundle.tar.xz' >> .git/info/exclude
tar -C "$STAGE" -cJf .gpu-bundle.tar.xz bin lib $([ -d "$STAGE/python" ] && echo python)
rm -rf "$STAGE"
echo "gpu_bundle: $(du -h .gpu-bundle.tar.xz | cut -f1) in .gpu-bundle.tar.xz ($(tar -tJf .gpu-bundle.tar.xz | grep -c '^lib/.') libraries)"
