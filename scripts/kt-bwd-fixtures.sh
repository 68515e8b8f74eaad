#!/usr/bin/env bash
# Rewrites tests/fixtures/kt_bwd: KT-Kernel 0.7.2's own backward transposes (its SFT wrapper's
# save_backward_weights_from_tensors, AMXINT4) for small layers, which host/tests/kt_fixtures.rs
# checks `kt convert --backward`'s bytes against. KT's SFT wrapper needs torch: it comes from
# $KT_TORCH_PYTHON, by default the environment scripts/sglang-env.sh caches. The wheel is
# fetched as scripts/kt-fixtures.sh does, never committed.
#
#   bash scripts/kt-bwd-fixtures.sh [VARIANT]     (KT_KERNEL_CPU_VARIANT, default avx512)
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
source "$here/peers/kt_wheel.sh"
variant=${1:-avx512}
kt_wheel_ext avx512_bf16 >/dev/null
unpacked=${KT_PEER_CACHE:-$HOME/.cache/kt-peer}/unpacked
py=${KT_TORCH_PYTHON:-$HOME/.cache/kt-kernel-rs/sglang/env/bin/python}
"$py" -c "import torch, safetensors" 2>/dev/null ||
    { echo "KT's SFT needs torch and safetensors: run scripts/sglang-env.sh or set KT_TORCH_PYTHON" >&2; exit 1; }
out="$here/../tests/fixtures/kt_bwd"
rm -rf "$out.new" && mkdir -p "$out.new"
# KT's extension chatters on stdout: only the driver's own lines are shown.
for c in int4_parts2 int4_k3712; do
    (cd /tmp && PYTHONPATH="$unpacked:$here/peers" KT_KERNEL_CPU_VARIANT=$variant "$py" "$here/peers/kt_bwd_fixtures.py" "$out.new" $c 2>/dev/null) |
        grep '^kt-bwd-fixtures:'
done
chmod 644 "$out.new"/*/*.safetensors
rm -rf "$out" && mv "$out.new" "$out"
echo "kt-bwd-fixtures: wrote $(du -sh "$out" | cut -f1) under tests/fixtures/kt_bwd ($variant)"
