# Sourced by the setup scripts: pip_install VENV PIP-ARGS... installs into the virtualenv VENV with uv (from PyPI,
# pinned, in .venv-uv beside the repository's other environments), or with the environment's own pip where uv
# cannot be installed. pip spends a core for minutes on torch's wheels (a Python loop that downloads, hashes and
# unpacks them); uv does the same in seconds and keeps what it unpacked in its cache, so an environment made again
# links it instead of downloading it.
UV_VERSION=0.13.9
PIP_INSTALL_ROOT=${PIP_INSTALL_ROOT:-$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)}

uv_bin() {  # prints uv's path, installing it first (once: setup scripts run at once take turns), or fails
  local tools=$PIP_INSTALL_ROOT/.venv-uv
  [ "${CROSSKV_NO_UV:-0}" = 1 ] && return 1
  (
    flock 9
    case $("$tools/bin/uv" --version 2> /dev/null) in "uv $UV_VERSION "*) exit 0 ;; esac
    rm -rf "$tools"
    /usr/bin/python3 -m venv "$tools" && "$tools/bin/pip" install -q --disable-pip-version-check "uv==$UV_VERSION"
  ) 9> "$PIP_INSTALL_ROOT/.venv-uv.lock" > /dev/null 2>&1 || return 1
  echo "$tools/bin/uv"
}

pip_install() {  # pip_install VENV ARGS...: pip install's arguments (-q, --no-deps, -r FILE, packages)
  local venv=$1 uv; shift
  if uv=$(uv_bin); then
    "$uv" pip install --python "$venv/bin/python" "$@"
  else
    "$venv/bin/pip" install --no-cache-dir --disable-pip-version-check "$@"
  fi
}
