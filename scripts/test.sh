#!/usr/bin/env bash
# Every test: formatting, lints (all features and reference-only), rustdoc's link checks, the
# no_std core built alone, the workspace tests, loom model checks, the Python package (wheel
# built with maturin as a manylinux wheel, installed in a venv, pytest), a 20-second soak, and
# short fuzz smoke runs. CI runs exactly this (.ci/run).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh --test

echo "== fmt"
cargo fmt --all --check
(cd fuzz && cargo fmt --check)
cargo fmt --manifest-path bindings/python/Cargo.toml --check
echo "== clippy"
cargo clippy --workspace --all-targets -- -D warnings
CARGO_TARGET_DIR=target cargo clippy --manifest-path bindings/python/Cargo.toml -- -D warnings
cargo clippy -p kt-host --no-default-features --all-targets -- -D warnings
echo "== rustdoc (broken or private intra-doc links fail)"
RUSTDOCFLAGS="-D warnings" cargo doc --workspace --no-deps
echo "== no_std core, built alone"
cargo build -p kt-core
echo "== tests"
cargo test --workspace
cargo test -p kt-host --no-default-features
echo "== loom model checks of the task queue and the pools (own target dir: --cfg loom rebuilds every crate)"
RUSTFLAGS="--cfg loom" CARGO_TARGET_DIR=target/loom cargo test -p kt-host --release --test loom
echo "== Python package kt_kernel: wheel, install into target/pyenv, pytest"
bash scripts/python.sh
(cd bindings/python/tests && ../../../target/pyenv/bin/python -m pytest -q)
echo "== soak smoke (20 s; docs/reliability.md)"
bash scripts/soak.sh --seconds 20
echo "== fuzz smoke (${FUZZ_SECONDS:=20} s per target; the checkpoint and GGUF readers ${FUZZ_READER_SECONDS:=60} s)"
for t in quantize routing; do
    (cd fuzz && cargo fuzz run -s none "$t" -- -max_total_time="$FUZZ_SECONDS")
done
# Both readers start from small files the ecosystem's tools wrote (fuzz/seeds/<target>).
(cd fuzz && cargo fuzz run -s none checkpoint corpus/checkpoint seeds/checkpoint -- -max_total_time="$FUZZ_READER_SECONDS")
(cd fuzz && mkdir -p corpus/gguf && cargo fuzz run -s none gguf corpus/gguf seeds/gguf -- -max_total_time="$FUZZ_READER_SECONDS")
echo "all tests passed"
