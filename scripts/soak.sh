#!/usr/bin/env bash
# Soak: the Python package (scripts/soak.py) and `kt soak` (the Rust MoeLayer path) at the same
# time; 100 000 forwards each by default (a few minutes). Arguments go to soak.py (--forwards N,
# --seconds S); scripts/test.sh runs a 20-second smoke of it.
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x target/pyenv/bin/python ] && target/pyenv/bin/python -c "import kt_kernel" 2>/dev/null || bash scripts/python.sh
cargo build --release -q -p kt-host --bin kt
exec target/pyenv/bin/python scripts/soak.py --kt "${CARGO_TARGET_DIR:-target}/release/kt" "$@"
