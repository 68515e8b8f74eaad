#!/usr/bin/env bash
# Peer measurement: KT-Kernel's own CPU build (its PyPI wheel) against ours on the same layer
# shape, token counts and machine, back to back.
#
#   bash scripts/peer-kt.sh [VARIANT] [PRESET] [TOKENS] [METHODS]
#   e.g. bash scripts/peer-kt.sh avx512_bf16 qwen3-30b-a3b 1,4,256,1024 AMXINT8,AMXINT4,BF16,FP8,RAWINT4
#        bash scripts/peer-kt.sh avx2 qwen3-30b-a3b 1,4,256,1024 BF16,FP8,RAWINT4,MXFP4,MXFP8
#   (METHODS also MXFP4, MXFP8; KT's avx2 build has no AMXINT8/AMXINT4 class)
#
# VARIANT is one of the wheel's extensions (avx512_bf16, avx512_vbmi, avx512_vnni, avx512_base,
# avx2, amx); ours runs with KT_KERNEL_CPU_VARIANT set to the same name where we have it. The
# wheel (kt-kernel==0.7.2, ~100 MB) is downloaded at run time into $KT_PEER_CACHE
# (~/.cache/kt-peer) and never committed; its extension loads without torch and is driven by
# scripts/peers/kt_moe.py with numpy. KT runs with 1 and with 2 worker threads and is credited
# with the faster (on 2 vCPUs its spinning helper threads can make 2 workers slower); ours
# runs with 2. Each line: KT's best ms, ours, and KT / ours.
set -euo pipefail
variant=${1:-avx512_bf16}
preset=${2:-qwen3-30b-a3b}
tokens=${3:-1,4,256,1024}
methods=${4:-AMXINT8,AMXINT4,BF16,FP8,RAWINT4}
here=$(cd "$(dirname "$0")" && pwd)
source "$here/peers/kt_wheel.sh"
ext=$(kt_wheel_ext "$variant")
version=$KT_VERSION

cargo build --release --quiet -p kt-host --bin kt
ours_variant=$variant
[[ $variant == avx512_* || $variant == avx2 || $variant == amx ]] || ours_variant=""

declare -A ours_method=([AMXINT8]=int8 [AMXINT4]=int4 [BF16]=bf16 [FP8]=fp8 [RAWINT4]=int4-g32 [MXFP4]=mxfp4
    [MXFP8]=mxfp8)
echo "KT-Kernel $version $variant vs ours ($ours_variant), $preset, tokens $tokens"
printf '%-8s %6s %12s %10s %10s\n' method tokens "KT best ms" "ours ms" "KT/ours"
for m in ${methods//,/ }; do
    declare -A kt=()
    for th in 1 2; do
        while read -r n ms; do
            if [ -z "${kt[$n]:-}" ] || awk "BEGIN{exit !($ms < ${kt[$n]})}"; then kt[$n]=$ms; fi
        done < <(python3 "$here/peers/kt_moe.py" "$ext" --method "$m" --preset "$preset" --tokens "$tokens" \
            --threads $th --min-time 1 | sed -n 's/.* n=\([0-9]*\) best \([0-9.]*\) ms.*queued \([0-9.]*\) ms/\1 \2\n\1 \3/p')
    done
    KT_KERNEL_CPU_VARIANT=$ours_variant ./target/release/kt bench --preset "$preset" --method "${ours_method[$m]}" \
        --tokens "$tokens" --threads 2 --json 2>/dev/null |
        python3 -c '
import json, sys
for r in json.load(sys.stdin)["results"]:
    print(r["tokens"], r["ms_best"])' |
        while read -r n ms; do
            ratio=n/a
            [ -n "${kt[$n]:-}" ] && ratio=$(awk "BEGIN{printf \"%.2f\", ${kt[$n]} / $ms}")
            printf '%-8s %6s %12s %10.3f %10s\n' "$m" "$n" "${kt[$n]:-n/a}" "$ms" "$ratio"
        done
    unset kt
done
