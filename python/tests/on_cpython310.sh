#!/usr/bin/env bash
# The Python package's tests (python/tests, as .ci/run runs them) on CPython 3.10, the
# oldest version the abi3 wheel claims (pyproject.toml: requires-python = ">=3.10"),
# on a machine that has no CPython 3.10: Ubuntu 22.04's (jammy's) python3.10 packages,
# downloaded at pinned versions, checked against the SHA-256 sums of jammy's Packages
# index (written below), unpacked with `dpkg-deb -x` into a scratch folder (no root,
# no apt) and run from there. Needs dpkg-deb, curl, glibc 2.35 or later (jammy's build:
# Debian 12 or Ubuntu 22.04 and later), a python3 with venv and pip for virtualenv, and
# network access to an Ubuntu mirror and to PyPI. Not a CI step: CI's network reach to
# the mirror is not guaranteed.
# Usage: python/tests/on_cpython310.sh
# Env: COHORT_WHEEL (a wheel built already; else one is built here with maturin 1.16.0,
#        `maturin build --locked --profile dev`, the profile .ci/run installs),
#      COHORT_BIN (the `cohort` binary for the tests that compare with it; default
#        $CARGO_TARGET_DIR/debug/cohort, as .ci/run sets it, built with cargo if missing),
#      COHORT_BUILD_LOCK (a file: every cargo or maturin build here runs under
#        `flock` on it, for a machine where other builds share the target folder),
#      UBUNTU_MIRROR (default http://archive.ubuntu.com/ubuntu),
#      KEEP=1 (keep the scratch folder, its path printed at the end).
set -euo pipefail
cd "$(dirname "$0")/../.."

export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$HOME/.cache/cohort-target}"
MIRROR="${UBUNTU_MIRROR:-http://archive.ubuntu.com/ubuntu}"
SCRATCH="$(mktemp -d)"
if [ -n "${KEEP:-}" ]; then
  trap 'echo "scratch folder kept: $SCRATCH"' EXIT
else
  trap 'rm -rf "$SCRATCH"' EXIT
fi

# jammy-updates' python3.10 (main, amd64), and libmpdec3 from jammy itself (the
# decimal module's library, which Debian 12 does not install by default). The
# other libraries these packages depend on (libssl3, libffi8, libexpat1, zlib1g,
# libsqlite3-0, ...) are the machine's own, checked below. Path in the pool, and
# the SHA-256 of the .deb as the Packages index lists it.
PACKAGES=(
  "pool/main/p/python3.10/python3.10-minimal_3.10.12-1~22.04.18_amd64.deb 34e4c7383fdf2562d78321acfee5aa1f7b92be371dd79410496ad35cb773f326"
  "pool/main/p/python3.10/libpython3.10-minimal_3.10.12-1~22.04.18_amd64.deb ccbd08562769e0a38b34005dc8bde200838e6c6530cc04ac34525129ed42d847"
  "pool/main/p/python3.10/libpython3.10-stdlib_3.10.12-1~22.04.18_amd64.deb ee09afbc981a4aaa00053f019eab6b45dcc4dbeb4ca4fcc4277eff539e09f228"
  "pool/main/m/mpdecimal/libmpdec3_2.5.1-2build2_amd64.deb 941ca0b2e73d26522f75a801b1bf529afa5ceb2ac9b00cbf324b59f474cae813"
)
VIRTUALENV_VERSION=21.15.14
MATURIN_VERSION=1.16.0

step() { printf '\n== %s (%s)\n' "$1" "$(date -u +%H:%M:%S)"; }
fail() { echo "error: $*" >&2; exit 1; }
build() {
  if [ -n "${COHORT_BUILD_LOCK:-}" ]; then flock "$COHORT_BUILD_LOCK" "$@"; else "$@"; fi
}

for tool in dpkg-deb curl sha256sum python3; do
  command -v "$tool" >/dev/null || fail "$tool is needed and not found"
done

step "jammy's python3.10 packages, pinned and checked"
root="$SCRATCH/root"
mkdir -p "$SCRATCH/debs" "$root"
for entry in "${PACKAGES[@]}"; do
  read -r path sum <<<"$entry"
  deb="$SCRATCH/debs/$(basename "$path")"
  if ! curl -fsSL --retry 3 -o "$deb" "$MIRROR/$path"; then
    fail "download of $MIRROR/$path failed (a version superseded in jammy-updates
       leaves the mirror's pool after a while: take the current one, its Filename and
       SHA256, from $MIRROR/dists/jammy-updates/main/binary-amd64/Packages.xz)"
  fi
  got="$(sha256sum "$deb" | cut -d' ' -f1)"
  [ "$got" = "$sum" ] || fail "$(basename "$path"): SHA-256 $got, expected $sum (from jammy's Packages index)"
  echo "$(basename "$path"): SHA-256 ok"
  dpkg-deb -x "$deb" "$root"
done

# The interpreter finds its standard library from its own path (usr/bin/python3.10
# -> usr/lib/python3.10), so no PYTHONHOME; the unpacked libmpdec is found through
# LD_LIBRARY_PATH, which the virtual environment's processes (the cohort workers
# among them) inherit.
export LD_LIBRARY_PATH="$root/usr/lib/x86_64-linux-gnu${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
python310="$root/usr/bin/python3.10"
missing="$(for module in "$root"/usr/lib/python3.10/lib-dynload/*.so; do
  ldd "$module" | awk -v m="$(basename "$module")" '/not found/ {print m ": " $1}'
done)"
[ -z "$missing" ] || fail "libraries the standard library's modules need are missing (install them):
$missing"
"$python310" -c 'import ssl, decimal, ctypes, sqlite3, lzma, bz2, zlib, pyexpat, uuid' ||
  fail "the unpacked python3.10 cannot import its standard library's C modules"

step "a virtual environment for it (virtualenv $VIRTUALENV_VERSION: Debian's python3.10 has no ensurepip)"
python3 -m venv "$SCRATCH/tools"
"$SCRATCH/tools/bin/pip" install --quiet --disable-pip-version-check "virtualenv==$VIRTUALENV_VERSION" ||
  fail "pip install of virtualenv failed"
venv="$SCRATCH/venv"
"$SCRATCH/tools/bin/virtualenv" --quiet -p "$python310" "$venv"
version="$("$venv/bin/python" -c 'import sys; print(sys.version)')"
echo "python: $version"
case "$version" in
  3.10.*) ;;
  *) fail "the virtual environment's python is $version, not 3.10" ;;
esac
"$venv/bin/pip" install --quiet --disable-pip-version-check numpy safetensors pytest ||
  fail "pip install of numpy, safetensors and pytest failed"

step "the cohort wheel"
if [ -z "${COHORT_WHEEL:-}" ]; then
  "$venv/bin/pip" install --quiet --disable-pip-version-check "maturin==$MATURIN_VERSION" ||
    fail "pip install of maturin failed"
  (cd python && build "$venv/bin/maturin" build --locked --profile dev --out "$SCRATCH/wheels")
  COHORT_WHEEL="$(ls "$SCRATCH"/wheels/cohort-*.whl)"
fi
[ -f "$COHORT_WHEEL" ] || fail "COHORT_WHEEL $COHORT_WHEEL not found"
"$venv/bin/pip" install --quiet --disable-pip-version-check "$COHORT_WHEEL" ||
  fail "pip install of $COHORT_WHEEL failed"
echo "installed $(basename "$COHORT_WHEEL")"

if [ -z "${COHORT_BIN:-}" ]; then
  COHORT_BIN="$CARGO_TARGET_DIR/debug/cohort"
  if [ ! -x "$COHORT_BIN" ]; then
    step "the cohort binary"
    build cargo build --locked -p cohort-cli --bin cohort
  fi
fi
[ -x "$COHORT_BIN" ] || fail "COHORT_BIN $COHORT_BIN is not an executable"

step "pytest python/tests on $("$venv/bin/python" -c 'import platform; print(platform.python_version())')"
# As in .ci/run: exit code 5, "no tests collected", fails like any other non-zero code.
pytest_rc=0
COHORT_BIN="$COHORT_BIN" "$venv/bin/python" -m pytest python/tests -q -p no:cacheprovider -rs || pytest_rc=$?
if [ "$pytest_rc" -eq 5 ]; then
  echo "error: pytest collected no tests in python/tests" >&2
fi
[ "$pytest_rc" -eq 0 ] || exit 1
