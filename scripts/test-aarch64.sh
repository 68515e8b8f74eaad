#!/usr/bin/env bash
# The aarch64 part of the test command: core (the reference backend in it) and the blis backend
# on Debian's arm64 BLIS (its cortexa57 NEON microkernel), and `kt info`, cross-built with Debian's own Rust
# (rustup's targets cannot be fetched here) and tested under qemu-user, the conformance suite
# at its quick depth (KT_CONFORMANCE=quick: emulation runs tens of times slower). Installs the
# Debian packages it needs (root); its build has its own target directory, target/aarch64.
#
# Two traps it avoids: rustup's rustc comes first on PATH and has no aarch64 standard library,
# so RUSTC names Debian's; and qemu's loader must be the multiarch libc6:arm64's (`-L /`): the
# cross toolchain's loader under /usr/aarch64-linux-gnu is of another glibc build than the
# libc.so.6 the arm64 libraries pull in, and with the two mixed pthread_create spins forever.
set -euo pipefail
cd "$(dirname "$0")/.."

packages=(rustc-web cargo-web libstd-rust-web-dev:arm64 gcc-aarch64-linux-gnu libc6:arm64 qemu-user
    libblis-pthread-dev:arm64)
if ! dpkg --print-foreign-architectures | grep -qx arm64; then
    dpkg --add-architecture arm64
    apt-get update -qq
fi
if ! dpkg -s "${packages[@]}" >/dev/null 2>&1; then
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${packages[@]}" >/dev/null \
        || { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${packages[@]}" >/dev/null; }
fi

export RUSTC=/usr/bin/rustc RUSTDOC=/usr/bin/rustdoc CARGO_TARGET_DIR=target/aarch64
export CARGO_TARGET_AARCH64_UNKNOWN_LINUX_GNU_LINKER=aarch64-linux-gnu-gcc
export CARGO_TARGET_AARCH64_UNKNOWN_LINUX_GNU_RUNNER="qemu-aarch64 -L /"
export CC_aarch64_unknown_linux_gnu=aarch64-linux-gnu-gcc
export KT_CONFORMANCE=quick KT_REQUIRE_ISA=blis  # (a blis test that skips fails)
echo "Debian's $(/usr/bin/rustc --version), target aarch64-unknown-linux-gnu, run by $(qemu-aarch64 --version | head -1)"
# The GGML layers' test (reference only, 24 s natively) is the one left out: its code is the
# same portable Rust as on x86, where the test command runs it.
/usr/bin/cargo test --target aarch64-unknown-linux-gnu -p kt-core -p kt-backend-blis \
    --features kt-backend-blis/system -- --skip reference_ggml_layers_match_fp32_on_dequantized_weights
# The command-line tool builds there too (without hwloc, which would need libhwloc-dev:arm64)
# and picks the blis backend for every format.
/usr/bin/cargo build --target aarch64-unknown-linux-gnu -p kt-host --no-default-features --features blis --bin kt
info=$(qemu-aarch64 -L / "$CARGO_TARGET_DIR/aarch64-unknown-linux-gnu/debug/kt" info)
echo "$info" | grep -E '^(BLIS|selected):'
echo "$info" | grep -qE '^selected: +blis$' || { echo "kt info on aarch64 did not select blis:"; echo "$info"; exit 1; }
