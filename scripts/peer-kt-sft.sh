#!/usr/bin/env bash
# Peer measurement: KT-Kernel's own SFT MoE (its PyPI wheel's kt_kernel.sft, which needs torch)
# against ours (kt bench --sft) on the same layer, LoRA rank, token counts and machine, back to
# back: each side's best forward-with-cache and backward, and KT's sum over ours.
#
#   bash scripts/peer-kt-sft.sh [VARIANT] [PRESET] [TOKENS] [METHODS]
#   e.g. bash scripts/peer-kt-sft.sh avx512 qwen3-30b-a3b 256,1024 AMXBF16_SFT,AMXINT4_SFT
#
# VARIANT is KT's KT_KERNEL_CPU_VARIANT (amx, avx512, avx2); ours picks its best backend. The
# wheel is fetched as scripts/peer-kt.sh does ($KT_PEER_CACHE, never committed); torch comes from
# $KT_TORCH_PYTHON, by default the environment scripts/sglang-env.sh caches. KT's AMXINT8_SFT
# takes only pre-converted files, so it is not driven here.
set -euo pipefail
variant=${1:-avx512}
preset=${2:-qwen3-30b-a3b}
tokens=${3:-256,1024}
methods=${4:-AMXBF16_SFT,AMXINT4_SFT}
rank=16
here=$(cd "$(dirname "$0")" && pwd)
source "$here/peers/kt_wheel.sh"
kt_wheel_ext avx512_bf16 >/dev/null
unpacked=${KT_PEER_CACHE:-$HOME/.cache/kt-peer}/unpacked
py=${KT_TORCH_PYTHON:-$HOME/.cache/kt-kernel-rs/sglang/env/bin/python}
"$py" -c "import torch" 2>/dev/null || { echo "KT's SFT needs torch: run scripts/sglang-env.sh or set KT_TORCH_PYTHON" >&2; exit 1; }

cargo build --release --quiet -p kt-host --bin kt
declare -A ours_method=([AMXBF16_SFT]=bf16 [AMXINT4_SFT]=int4)
echo "KT-Kernel $KT_VERSION SFT ($variant) vs ours, $preset, LoRA rank $rank, 2 threads, tokens $tokens"
printf '%-12s %6s %10s %10s %10s %10s %8s\n' method tokens "KT fwd" "KT bwd" "ours fwd" "ours bwd" "KT/ours"
for m in ${methods//,/ }; do
    declare -A kt=()
    while read -r n f b; do kt[$n]="$f $b"; done < <(
        cd /tmp && PYTHONPATH="$unpacked" KT_KERNEL_CPU_VARIANT=$variant "$py" "$here/peers/kt_sft.py" \
            --preset "$preset" --method "$m" --tokens "$tokens" --threads 2 --rank $rank 2>/dev/null |
            sed -n 's/^RESULT n=\([0-9]*\) forward \([0-9.]*\) backward \([0-9.]*\)$/\1 \2 \3/p')
    ./target/release/kt bench --sft $rank --preset "$preset" --method "${ours_method[$m]}" --tokens "$tokens" \
        --threads 2 --json 2>/dev/null |
        python3 -c '
import json, sys
for r in json.load(sys.stdin)["sft"]:
    print(r["tokens"], r["forward_ms"][0], r["backward_ms"][0])' |
        while read -r n f b; do
            read -r kf kb <<< "${kt[$n]:-nan nan}"
            ratio=$(awk "BEGIN{printf \"%.2f\", ($kf + $kb) / ($f + $b)}")
            printf '%-12s %6s %10s %10s %10.2f %10.2f %8s\n' "$m" "$n" "$kf" "$kb" "$f" "$b" "$ratio"
        done
    unset kt
done
