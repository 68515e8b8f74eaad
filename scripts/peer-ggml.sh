#!/usr/bin/env bash
# Peer measurement: ggml's MoE op (MUL_MAT_ID, what llama.cpp runs) on the qwen3-30b-a3b layer
# that `kt bench --preset qwen3-30b-a3b` times, on this machine, for comparison in one session.
#
#   bash scripts/peer-ggml.sh GGML_CHECKOUT [TOKENS] [THREADS] [TYPES...]
#
# GGML_CHECKOUT is a clone of github.com/ggml-org/ggml (never vendored here). It is built in
# GGML_CHECKOUT/build-peer (Release, -march=native, CPU_REPACK on); cmake and ninja come from pip
# when missing. Each type runs gate's shape (768 x 2048) and down's (2048 x 768) with the weights
# in plain buffers and in CPU_REPACK (llama.cpp's interleaved rows, where ggml has them for the
# type), and the layer's figure is 2*3*H*I*k*n / (2*gate + down) from the best times: ggml's
# activation quantization, SwiGLU and weighting are left out, in its favour.
set -euo pipefail
ggml=${1:?usage: peer-ggml.sh GGML_CHECKOUT [TOKENS] [THREADS] [TYPES...]}
n=${2:-512}
threads=${3:-$(nproc)}
shift $(( $# < 3 ? $# : 3 ))
types=("$@")
[ ${#types[@]} -gt 0 ] || types=(q4_K q8_0 q4_0)
here=$(cd "$(dirname "$0")" && pwd)
H=2048 I=768 E=128 K=8

if ! command -v cmake > /dev/null || ! command -v ninja > /dev/null; then
    python3 -m pip install --quiet --user cmake ninja
    export PATH="$HOME/.local/bin:$PATH"
fi
cmake -S "$ggml" -B "$ggml/build-peer" -G Ninja -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON \
    -DGGML_CPU_REPACK=ON -DGGML_BUILD_TESTS=OFF -DGGML_BUILD_EXAMPLES=OFF > /dev/null
ninja -C "$ggml/build-peer" ggml > /dev/null
lib="$ggml/build-peer/src"
bin="$ggml/build-peer/ggml_moe"
g++ -O2 -std=c++17 "$here/peers/ggml_moe.cpp" -I"$ggml/include" -L"$lib" -lggml -lggml-base -lggml-cpu \
    -Wl,-rpath,"$lib" -o "$bin"
echo "ggml $(git -C "$ggml" rev-parse --short HEAD), $threads thread(s), $n tokens, E=$E k=$K H=$H I=$I"

# Best milliseconds of one run, or nothing when it failed (ggml aborts on a type it cannot repack).
best() { "$bin" "$@" 2> /dev/null | tee /dev/stderr | sed -n 's/.*best \([0-9.]*\) ms.*/\1/p' || true; }
for t in "${types[@]}"; do
    for buft in CPU CPU_REPACK; do
        gate=$(best "$t" "$buft" "$n" "$I" "$H" "$E" "$K" "$threads" 3)
        down=$(best "$t" "$buft" "$n" "$H" "$I" "$E" "$K" "$threads" 3)
        if [ -n "$gate" ] && [ -n "$down" ]; then
            awk -v g="$gate" -v d="$down" -v n="$n" -v t="$t" -v b="$buft" -v h=$H -v i=$I -v k=$K 'BEGIN {
                ms = 2 * g + d
                printf "%s %s layer (2 x gate + down): %.3f ms, %.1f GOP/s\n", t, b, ms, 6 * h * i * k * n / ms / 1e6 }'
        else
            echo "$t $buft: not run (ggml failed: no such repacking for the type on this CPU)"
        fi
    done
done
