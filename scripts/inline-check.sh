#!/usr/bin/env bash
# Fail if a built library or binary calls a SIMD intrinsic as a function: an intrinsic called
# from a closure (`map`, `from_fn`) that lacks its caller's target features is compiled out of
# line, a call per vector where one instruction was meant (the kernels build arrays with their
# `array!` loop instead). `xgetbv` (run once, for feature detection) is allowed.
#   bash scripts/inline-check.sh FILE...
set -euo pipefail
status=0
for f in "$@"; do
    calls=$(objdump -d --no-show-raw-insn "$f" | grep -E 'call.*core_arch' | grep -v xgetbv || true)
    if [ -n "$calls" ]; then
        echo "$f calls SIMD intrinsics out of line (build the array with array!, not map/from_fn):"
        echo "$calls" | sed 's/.*<//' | sort | uniq -c
        status=1
    else
        echo "$f: no SIMD intrinsic called out of line"
    fi
done
exit $status
