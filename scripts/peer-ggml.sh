#!/usr/bin/env bash
# Peers of the GGUF (llamafile) backend, timed on the qwen3-30b-a3b layer in the same run as our
# `kt bench` of the same types: mainline ggml's MoE op (MUL_MAT_ID, what llama.cpp runs) with the
# weights in plain buffers and in CPU_REPACK (llama.cpp's interleaved rows), its AMX buffer type
# where the CPU has AMX (one MUL_MAT per expert: that type does not serve MUL_MAT_ID), and
# ik_llama.cpp's row-interleaved types (q4_0_r8, q8_0_r8, q4_k_r4, ...).
#
#   bash scripts/peer-ggml.sh [TOKENS] [THREADS] [TYPES...]
#
# Checkouts (never vendored here): GGML_SRC (default ~/.cache/kt-peer/ggml) and IK_SRC
# (~/.cache/kt-peer/ik_llama.cpp), cloned from GitHub when absent; IK_SRC=none skips
# ik_llama.cpp and GGML_SRC=none mainline ggml (whose quantizers take minutes a shape for the
# lattice types on a small VM). Each is built in <checkout>/build-peer (Release,
# -march=native; cmake and ninja from pip when missing) with our small harness,
# scripts/peers/ggml_moe.cpp. Each peer runs
# gate's shape (768 x 2048) and down's (2048 x 768); its layer time is 2 x gate + down from the
# best times, which leaves out its activation quantization, SwiGLU, weighting and gather, in its
# favour. Ours is `kt bench`'s whole layer (best time, with its ratio to the roofline that the same
# run measured and the peak that judged it).
set -euo pipefail
n=${1:-512}
threads=${2:-$(nproc)}
shift $(( $# < 2 ? $# : 2 ))
types=("$@")
[ ${#types[@]} -gt 0 ] || types=(q4_0 q8_0 q4_K q5_K q6_K iq4_xs)
here=$(cd "$(dirname "$0")" && pwd)
cache=${XDG_CACHE_HOME:-$HOME/.cache}/kt-peer
ggml=${GGML_SRC:-$cache/ggml}
ik=${IK_SRC:-$cache/ik_llama.cpp}
H=2048 I=768 E=128 K=8

# ik_llama.cpp's row-interleaved form of each type (none: not run there).
declare -A ik_type=([q4_0]=q4_0_r8 [q8_0]=q8_0_r8 [q2_K]=q2_k_r4 [q3_K]=q3_k_r4 [q4_K]=q4_k_r4 [q5_K]=q5_k_r4 [q6_K]=q6_k_r4 [iq4_xs]=iq4_xs_r8
    [mxfp4]=mxfp4_r8 [iq4_nl]=iq4_nl_r4 [iq2_xxs]=iq2_xxs_r4 [iq3_xxs]=iq3_xxs_r4 [iq1_s]=iq1_s_r4
    [iq1_m]=iq1_m_r4 [iq2_xs]=iq2_xs_r4 [iq2_s]=iq2_s_r4 [iq3_s]=iq3_s_r4)
# Our method name of a ggml type, where it differs (`mxfp4` alone names KT's MXFP4).
ours_name() { [ "$1" = mxfp4 ] && echo ggml-mxfp4 || echo "$1" | tr '[:upper:]' '[:lower:]'; }

if ! command -v cmake > /dev/null || ! command -v ninja > /dev/null; then
    python3 -m pip install --quiet --user cmake ninja
    export PATH="$HOME/.local/bin:$PATH"
fi
fetch() { # DIR URL
    [ -d "$1" ] || git clone --quiet --depth 1 "$2" "$1"
}

if [ "$ggml" != none ]; then
    fetch "$ggml" https://github.com/ggml-org/ggml
    cmake -S "$ggml" -B "$ggml/build-peer" -G Ninja -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON \
        -DGGML_CPU_REPACK=ON -DGGML_BUILD_TESTS=OFF -DGGML_BUILD_EXAMPLES=OFF > /dev/null
    ninja -C "$ggml/build-peer" ggml > /dev/null
    g++ -O2 -std=c++17 "$here/peers/ggml_moe.cpp" -I"$ggml/include" -L"$ggml/build-peer/src" -lggml -lggml-base \
        -lggml-cpu -Wl,-rpath,"$ggml/build-peer/src" -o "$ggml/build-peer/ggml_moe"
    echo "ggml $(git -C "$ggml" rev-parse --short HEAD 2> /dev/null || echo '(no git)')"
fi
if [ "$ik" != none ]; then
    fetch "$ik" https://github.com/ikawrakow/ik_llama.cpp
    # Its ggml is built on its own: C++20 (std::barrier), and the pkg-config template it names.
    [ -f "$ik/ggml/ggml.pc.in" ] || touch "$ik/ggml/ggml.pc.in"
    cmake -S "$ik/ggml" -B "$ik/build-peer" -G Ninja -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON \
        -DCMAKE_CXX_STANDARD=20 -DGGML_BUILD_TESTS=OFF -DGGML_BUILD_EXAMPLES=OFF > /dev/null
    ninja -C "$ik/build-peer" ggml > /dev/null
    g++ -O2 -std=c++17 -DPEER_IK "$here/peers/ggml_moe.cpp" -I"$ik/ggml/include" -L"$ik/build-peer/src" -lggml \
        -Wl,-rpath,"$ik/build-peer/src" -o "$ik/build-peer/ggml_moe"
    echo "ik_llama.cpp $(git -C "$ik" rev-parse --short HEAD 2> /dev/null || echo '(no git)')"
fi
amx=$(grep -q amx_int8 /proc/cpuinfo && echo yes || echo no)

# Ours first: the whole layer, best of kt bench's reps.
(cd "$here/.." && cargo build --release --quiet -p kt-host --bin kt)
methods=$(for t in "${types[@]}"; do ours_name "$t"; done | paste -sd,)
ours=$("$here/../target/release/kt" bench --preset qwen3-30b-a3b --method "$methods" --tokens "$n" \
    --threads "$threads" --json 2> /dev/null)
echo "$threads thread(s), $n tokens, E=$E k=$K H=$H I=$I, AMX: $amx"

# A peer's layer time in ms (2 x gate + down, best times), or "-" where it did not run.
layer() { # BIN TYPE BUFT
    local g d
    g=$("$1" "$2" "$3" "$n" "$I" "$H" "$E" "$K" "$threads" 3 2> /dev/null | sed -n 's/.*best \([0-9.]*\) ms.*/\1/p' || true)
    d=$("$1" "$2" "$3" "$n" "$H" "$I" "$E" "$K" "$threads" 3 2> /dev/null | sed -n 's/.*best \([0-9.]*\) ms.*/\1/p' || true)
    if [ -n "$g" ] && [ -n "$d" ]; then awk -v g="$g" -v d="$d" 'BEGIN { printf "%.2f", 2 * g + d }'; else echo -; fi
}
echo
echo "| type | ours ms (roof×, peak) | ggml ms | ggml CPU_REPACK ms | ggml AMX ms | ik_llama.cpp ms | best peer / ours |"
echo "|---|---|---|---|---|---|---|"
for t in "${types[@]}"; do
    # Best ms, then its ratio to the same run's roofline and the peak that judged it.
    read -r mine roof < <(python3 -c 'import json,sys
r=[x for x in json.loads(sys.argv[1])["results"] if x["method"].lower()==sys.argv[2].lower()]
print("%.2f %.2f,%s" % (r[0]["ms_best"], r[0]["roofline_ratio"], r[0]["judged_by"]) if r else "- -")' "$ours" "$(ours_name "$t")")
    plain=- repack=- tiles=-
    if [ "$ggml" != none ]; then
        plain=$(layer "$ggml/build-peer/ggml_moe" "$t" CPU)
        repack=$(layer "$ggml/build-peer/ggml_moe" "$t" CPU_REPACK)
        [ "$amx" = yes ] && tiles=$(layer "$ggml/build-peer/ggml_moe" "$t" AMX)
    fi
    ikt=-
    if [ "$ik" != none ] && [ -n "${ik_type[$t]:-}" ]; then
        ikt="$(layer "$ik/build-peer/ggml_moe" "${ik_type[$t]}" CPU) (${ik_type[$t]})"
    fi
    ratio=$(awk -v m="$mine" -v a="$plain" -v b="$repack" -v c="$tiles" -v d="${ikt%% *}" 'BEGIN {
        best = 0; n = split(a " " b " " c " " d, v, " ")
        for (i = 1; i <= n; i++) if (v[i] != "-" && (best == 0 || v[i] + 0 < best)) best = v[i] + 0
        if (m == "-" || best == 0) print "-"; else printf "%.2fx\n", best / m }')
    cell=$mine
    [ "$mine" = - ] || cell="$mine (${roof%%,*}×, ${roof#*,})"
    echo "| $t | $cell | $plain | $repack | $tiles | $ikt | $ratio |"
done
