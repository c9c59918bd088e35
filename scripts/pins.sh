# Sourced by scripts/setup.sh and scripts/test.sh: installs of pinned requirements.
#
# pinned_install PYTHON PIP-ARGS...: what `PYTHON -m pip install PIP-ARGS` installs (no bytecode
# compiled: see setup.sh), from a wheelhouse kept between clones on this machine. Most of a fresh install
# was pip reading package indexes (about 25 s of CPU for ~180 pinned packages, before any file is
# unpacked); the wheelhouse is filled once per set of pins (the same look-ups) and every later install of
# that set reads only it (--no-index). ANDREA_WHEELHOUSE=DIR puts the wheelhouses there (default
# ~/.cache/andrea-wheels, apart from the data caches; a folder per set of pins, named by their hash);
# ANDREA_WHEELHOUSE= (empty) keeps none. Should the wheelhouse fail (a wheel torn or removed by hand),
# it is removed and pip installs from the indexes as before.
#
# From the wheelhouse the installer is uv (UV_PIN: its wheel kept in the wheelhouse too where the
# platform has one, installed into PYTHON's venv by pip): the same wheels and versions (pip freeze
# compared), each package linked from uv's cache (~/.cache/uv, UV_CACHE_DIR) where pip unpacked every
# wheel again: ~180 pins 28 CPU-s with pip, 7 with uv the first time, 0.6 once uv's cache holds them.
# Where uv does not install, pip does.
UV_PIN="uv==0.13.10"

pinned_install() {
  local -
  set -o pipefail
  local python=$1
  shift
  local pip=("$python" -m pip install --quiet --disable-pip-version-check --no-compile)
  local root=${ANDREA_WHEELHOUSE-${XDG_CACHE_HOME:-$HOME/.cache}/andrea-wheels}
  if [ -n "$root" ]; then
    # The set of pins: the files named by -r/-c, and the interpreter the wheels are built for.
    local key arg
    key=$({
      "$python" -c 'import sys, sysconfig; print(sys.version, sysconfig.get_platform())'
      echo "$UV_PIN"
      for arg in "$@"; do if [ -f "$arg" ]; then cat "$arg"; fi; done
    } | sha256sum | cut -c1-16)
    local house="$root/$key"
    if [ ! -f "$house/.complete" ]; then
      echo "setup: filling the wheelhouse $house (once for these pins)"
      mkdir -p "$root"
      local partial
      partial=$(mktemp -d "$root/.partial-XXXXXX")
      # Wheels only (`pip wheel`: a package published as source is built here, once), as an install
      # that reads no index could not fetch the build dependencies of a source package.
      if "$python" -m pip wheel --quiet --disable-pip-version-check -w "$partial" "$@" 2>&1 | _pip_quiet; then
        # The installer (below), best effort: a platform without its wheel installs with pip.
        "$python" -m pip wheel --quiet --disable-pip-version-check --no-deps -w "$partial" "$UV_PIN" \
          >/dev/null 2>&1 || true
        touch "$partial/.complete"
        mv -T "$partial" "$house" 2>/dev/null || rm -rf "$partial" # another setup filled it first
      else
        rm -rf "$partial"
      fi
    fi
    if [ -f "$house/.complete" ]; then
      touch "$house/.complete" # in use: kept by the pruning below
      # Wheelhouses of pins no setup has used for 30 days go, and fills killed halfway a day ago.
      local other
      for other in "$root"/*/ "$root"/.partial-*/; do
        other=${other%/}
        if [ ! -d "$other" ] || [ "$other" = "$house" ]; then continue; fi
        case $other in
          */.partial-*) if [ -n "$(find "$other" -maxdepth 0 -mmin +1440)" ]; then rm -rf "$other"; fi ;;
          *) if [ -n "$(find "$other/.complete" -mtime +30 2>/dev/null)" ]; then rm -rf "$other"; fi ;;
        esac
      done
      local from=(--no-index --find-links "$house")
      if "${pip[@]}" "${from[@]}" "$UV_PIN" >/dev/null 2>&1 \
        && "$python" -m uv pip install --quiet --python "$python" "${from[@]}" "$@"; then
        return 0
      fi
      echo "setup: uv did not install from the wheelhouse $house; pip does" >&2
      if "${pip[@]}" "${from[@]}" "$@" 2>&1 | _pip_quiet; then
        return 0
      fi
      # A wheel torn or removed by hand: the next setup fills it anew.
      echo "setup: the wheelhouse $house did not install (removed); from the package indexes instead" >&2
      rm -rf "$house"
    fi
  fi
  "${pip[@]}" "$@" 2>&1 | _pip_quiet
}

# editable_install PYTHON: the project itself, editable, no dependencies (they are pinned_install's): by
# uv where pinned_install put it in PYTHON's venv (it keeps the build backend, setuptools, in its cache;
# pip fetches it from the index into a fresh build environment each time: 4.3 -> 1.2 CPU-s), else pip.
editable_install() {
  local -
  set -o pipefail
  local python=$1
  if "$python" -m uv pip install --quiet --python "$python" --no-deps -e . 2>/dev/null; then
    return 0
  fi
  "$python" -m pip install --quiet --disable-pip-version-check --no-compile --no-deps -e . 2>&1 | _pip_quiet
}

# pip's warning for each package an extra index (a file:// one of this machine's pip.conf) lacks.
_pip_quiet() {
  grep -v "is ignored: it is neither a file nor a directory" || true
}
