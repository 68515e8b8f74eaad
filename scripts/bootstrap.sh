#!/usr/bin/env bash
# Installs what this project needs on a fresh Debian machine that has the Rust toolchain and
# Python: the rustfmt/clippy components, Debian packages, and (with --test) cargo-fuzz for the
# fuzz smoke runs. Installs only what is missing, so a second run does nothing.
set -euo pipefail

need_test=0
[ "${1:-}" = "--test" ] && need_test=1

command -v cargo >/dev/null || { echo "bootstrap: cargo not found; install the Rust toolchain (rustup) first" >&2; exit 1; }

# Debian packages: pkg-config for -sys crates; hwloc (and udev, which its static pkg-config
# probe links) for the topology.
apt_packages=(pkg-config libhwloc-dev libudev-dev)
# Debian's python3 needs python3-venv for the Python package's venv.
python3 -m venv --help >/dev/null 2>&1 || apt_packages+=(python3-venv)
# objdump, for the test that no SIMD intrinsic is called out of line (scripts/inline-check.sh).
[ $need_test -eq 1 ] && ! command -v objdump >/dev/null && apt_packages+=(binutils)
# The system BLIS library (one threading flavour: the blis backend's tests; docs/blis.md).
[ $need_test -eq 1 ] && apt_packages+=(libblis-pthread-dev)
missing=()
for p in "${apt_packages[@]}"; do
    dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
    sudo_cmd=""
    [ "$(id -u)" -ne 0 ] && sudo_cmd="sudo"
    echo "bootstrap: installing ${missing[*]}" >&2
    $sudo_cmd apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $sudo_cmd apt-get install -y -qq "${missing[@]}"
fi

if [ $need_test -eq 1 ]; then
    for c in rustfmt clippy; do
        cargo "${c/rustfmt/fmt}" --version >/dev/null 2>&1 || rustup component add "$c"
    done
    command -v cargo-fuzz >/dev/null || cargo install cargo-fuzz --locked --quiet
fi
