#!/usr/bin/env bash
# The main job: install what is missing, build `kt` in release mode, and benchmark one MoE layer
# (default preset qwen3-30b-a3b) against the roofline measured in the same run.
# Extra arguments go to `kt bench`, e.g. `bash scripts/run.sh --method int8,int4 --tokens 1,256`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh
cargo build --release -p kt-host --bin kt
kt="${CARGO_TARGET_DIR:-target}/release/kt"
"$kt" info
exec "$kt" bench "$@"
