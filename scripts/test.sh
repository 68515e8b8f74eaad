#!/usr/bin/env bash
# Every test: formatting, import circles, lints (default features, reference-only, the tile floor),
# rustdoc's link checks, the no_std core built alone, the workspace tests, the blis backend on the
# system BLIS library (and on aarch64 under qemu), loom model checks, the Python package (wheel
# built with maturin as a manylinux wheel, installed in a venv, pytest, mypy; no SIMD intrinsic
# called out of line in it), SGLang's own integration code driving it and kt_kernel.sft in torch's
# autograd (torch and SGLang's wheels in a cache outside the checkout), a 20-second soak, and short
# fuzz smoke runs. CI runs exactly this (.ci/run).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh --test

echo "== fmt"
cargo fmt --all --check
(cd fuzz && cargo fmt --check)
cargo fmt --manifest-path bindings/python/Cargo.toml --check
echo "== no file imports a file that imports it (Rust crates, the Python package)"
python3 scripts/import-circles.py
echo "== clippy"
cargo clippy --workspace --all-targets -- -D warnings
CARGO_TARGET_DIR=target cargo clippy --manifest-path bindings/python/Cargo.toml -- -D warnings
cargo clippy -p kt-host --no-default-features --all-targets -- -D warnings
cargo clippy -p kt-host --features tile-floor --all-targets -- -D warnings
echo "== rustdoc (broken or private intra-doc links fail, the private items' docs too)"
RUSTDOCFLAGS="-D warnings" cargo doc --workspace --no-deps --document-private-items
echo "== no_std core, built alone"
cargo build -p kt-core
echo "== tests"
cargo test --workspace
cargo test -p kt-host --no-default-features
echo "== the blis backend on the system BLIS library (its feature: clippy, rustdoc, the conformance suite)"
cargo clippy -p kt-host --features blis --all-targets -- -D warnings
RUSTDOCFLAGS="-D warnings" cargo doc -p kt-backend-blis --features system --no-deps --document-private-items
cargo test -p kt-backend-blis --features system
echo "== aarch64: core and the blis backend on arm64 BLIS under qemu (scripts/test-aarch64.sh)"
bash scripts/test-aarch64.sh
echo "== loom model checks of the task queue and the pools (own target dir: --cfg loom rebuilds every crate)"
RUSTFLAGS="--cfg loom" CARGO_TARGET_DIR=target/loom cargo test -p kt-host --release --test loom
echo "== Python package kt_kernel: wheel, install into target/pyenv, pytest"
bash scripts/python.sh
(cd bindings/python/tests && ../../../target/pyenv/bin/python -m pytest -q)
echo "== the wheel with the blis backend, forced, against the numpy MoE (scripts/python-blis.sh)"
bash scripts/python-blis.sh
echo "== mypy on the Python package (its type hints, py.typed and the native extension's stub)"
(cd bindings/python && ../../target/pyenv/bin/python -m mypy)
echo "== no SIMD intrinsic compiled out of line in the built extension"
bash scripts/inline-check.sh target/pyenv/lib/python3*/site-packages/kt_kernel/kt_kernel_ext*.so
echo "== SGLang's own KT integration code (upstream and KT's fork, from their wheels) on our package, and kt_kernel.sft, with torch"
bash scripts/sglang-tests.sh
echo "== soak smoke (20 s; docs/reliability.md)"
bash scripts/soak.sh --seconds 20
echo "== fuzz smoke (${FUZZ_SECONDS:=20} s per target; the checkpoint and GGUF readers ${FUZZ_READER_SECONDS:=60} s)"
# Each run reads the committed corpus (fuzz/corpus/<target>) and, for the readers, the seeds
# the ecosystem's tools wrote (fuzz/seeds/<target>); what it finds goes to fuzz/target/smoke,
# so the committed corpus changes only by a campaign (scripts/fuzz-campaign.sh).
smoke() {
    local t=$1 seconds=$2
    local dirs=("target/smoke/$t" "corpus/$t")
    [ -d "fuzz/seeds/$t" ] && dirs+=("seeds/$t")
    mkdir -p "fuzz/target/smoke/$t"
    (cd fuzz && cargo fuzz run -s none "$t" "${dirs[@]}" -- -max_total_time="$seconds")
}
smoke quantize "$FUZZ_SECONDS"
smoke routing "$FUZZ_SECONDS"
smoke checkpoint "$FUZZ_READER_SECONDS"
smoke gguf "$FUZZ_READER_SECONDS"
echo "all tests passed"
