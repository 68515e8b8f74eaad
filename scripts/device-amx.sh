#!/usr/bin/env bash
# The AMX measurements #32 and #33 need, as one prepared run for a lent AMX machine (the device:
# no internet, a bare system, minutes of time), built and packed here first.
#
#   bash scripts/device-amx.sh prepare          # here: binaries, libraries, KT's AMX extension into .dev/
#                                               #   (each loaded here by a CPython of its version)
#   bash scripts/device-amx.sh run [PHASE...]   # there (carry .dev): results into $OUT
#   bash scripts/device-amx.sh summary DIR      # anywhere: the tables from a run's files
#
# Phases, in the order `run` takes them when none is named (each skipped once the run's
# deadline, DEADLINE_S seconds from its start, default 540, is too near):
#   tests      the AMX tests on the hardware tiles: the amx backend's (conformance, tiles =
#              AVX-512 bits), the GGUF tile kernels' (tiles = vector bits), KT's fixtures
#   kt         KT-Kernel 0.7.2's AMX build on the table's shapes (scripts/peers/kt_moe.py)
#   gguf       GGUF prefill n = 512, 2048 on tiles (from 2 tokens an expert) and off (the default)
#   profile    flat `perf` profiles (carried: the device has none) of int8, int4, fp8 on the
#              amx backend and q4_0 on tiles, n = 1024, 2 threads
#   floor      the `tile-floor` build's times (the tile path without its products) at n = 256,
#              1024, to set beside the table's
#   tables     the AMX table: amx and avx512 backends, n = 1, 4, 256, 1024, 2 and 16 threads
#   decode     MX decode: mxfp4, mxfp8 (int4, bf16 beside them) at n = 1, 4 against a paired
#              DRAM stream (`stream×`), 2 and 16 threads; the forward's stages at 16 (--stages)
#   tile-from  the tile thresholds: each format at n = 16 … 256 (1, 2, 4, 8, 16 tokens an expert
#              on average) with every expert on tiles (KT_AMX_TILE_FROM=1) and none, first
#              those set by kin (mxfp8, int4-g128)
#   gemm       the hot-weight GEMM bench (`cargo bench -p kt-backend-amx --bench gemm`: one
#              2048 × 7168 expert, 256 tokens, one thread) against the tile peaks it times
# Each phase writes one file into $OUT (at most 8 come back from the device) and its lines into
# $OUT/log.txt; `summary` prints the tables from them. Timed on the 16-core Xeon (2026-12-04):
# tests 60 s, decode 45 s, tables 230 s, gemm 60 s, tile-from 330 s (KT's steps did not load
# that day, the others were new since). A lease of 15 device minutes holds about two calls, the
# first starting the machine (~1 minute): `run` (DEADLINE_S=545, timeout_s=600: the phases in
# the order above), then at once, while the machine is warm, `run` with the phases the first
# skipped and DEADLINE_S fitted to what is left of the lease (`status`).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/.." && pwd)
dev=$root/.dev
KT_FORMATS=int8,int4,bf16,fp8,int4-g32,mxfp4
# The formats whose tile thresholds were set by kin, not measured (2026-12-04).
UNMEASURED=mxfp8,int4-g128
GGUF_TYPES=q4_0,q8_0,q4_k,q5_k,q6_k,iq4_xs

# executables PREFIX TARGET...: from cargo's JSON messages on stdin, copy the executables of
# the named targets into .dev/bin as PREFIX + target name.
executables() {
    python3 -c '
import json, sys, shutil
prefix, names = sys.argv[2], sys.argv[3:]
for line in sys.stdin:
    m = json.loads(line)
    name = m.get("target", {}).get("name")
    if m.get("executable") and name in names:
        shutil.copy(m["executable"], sys.argv[1] + "/" + prefix + name)
' "$dev/bin" "$@"
}

prepare() {
    cd "$root"
    rm -rf "$dev" && mkdir -p "$dev/bin" "$dev/lib" "$dev/kt"
    cargo build --release -p kt-host --bin kt
    cp target/release/kt "$dev/bin/kt"
    # The test binaries of the crates with tile kernels, KT's byte-compatibility fixtures and
    # the hot-weight GEMM bench (divan).
    cargo test --release -p kt-backend-amx -p kt-backend-llamafile -p kt-host --test kt_fixtures --lib \
        --no-run --message-format=json 2>/dev/null | executables test- kt_backend_amx kt_backend_llamafile kt_fixtures
    cargo bench -p kt-backend-amx --bench gemm --no-run --message-format=json 2>/dev/null | executables bench- gemm
    # The tile-floor build: tile products that do nothing, the rest of the tile path timed.
    cargo build --release -p kt-host --bin kt --features tile-floor --target-dir target/floor
    cp target/floor/release/kt "$dev/bin/kt-floor"
    # `kt` keeps its symbols for the profile.
    strip --strip-debug "$dev"/bin/kt "$dev"/bin/kt-floor
    strip "$dev"/bin/test-* "$dev"/bin/bench-*
    pack_perf
    for l in libhwloc.so.15 libudev.so.1; do cp -L "$(ldconfig -p | awk -v l=$l '$1 == l {print $NF; exit}')" "$dev/lib/"; done
    # shellcheck source=peers/kt_wheel.sh
    source "$here/peers/kt_wheel.sh"
    # This machine's CPython and the device's (3.12 when last seen; DEVICE_PY to change it):
    # `kt` picks the one its python3 loads.
    for py in "" "${DEVICE_PY:-312}"; do
        ext=$(kt_wheel_ext amx $py)
        cp "$ext" "$dev/kt/" && cp -r "$(dirname "$ext")/../kt_kernel.libs" "$dev/kt/"
        kt_loads "$ext"
    done
    ls -l "$dev/bin"
    echo "device-amx: $(du -sh "$dev" | cut -f1) in .dev (carry limit 64 MiB with the tree); on the device:"
    echo "  run(command='bash scripts/device-amx.sh run', carry=['.dev'], timeout_s=600)"
}

# kt_loads EXT: load KT's extension EXT here with a CPython of its version (python3.X on PATH
# or pyenv's), as the device will, so that a wheel its Python cannot load shows before the
# device time is spent; a version not found here is reported unchecked.
kt_loads() {
    local ext=$1 v py="" c
    v=$(basename "$ext" | sed -E 's/.*cpython-3([0-9]+)-.*/3.\1/')
    # (pyenv's shims stand on PATH for versions not selected: each candidate must run.)
    for c in $(command -v "python$v") "$HOME"/.pyenv/versions/"$v".*/bin/"python$v"; do
        [ -x "$c" ] && "$c" -c '' 2>/dev/null && { py=$c; break; }
    done
    if [ -z "$py" ]; then
        echo "device-amx: no CPython $v here: $(basename "$ext") not checked"
        return 0
    fi
    LD_LIBRARY_PATH="$(dirname "$ext")/../kt_kernel.libs" "$py" -c '
import importlib.util, sys
spec = importlib.util.spec_from_file_location("kt_kernel_ext", sys.argv[1])
spec.loader.exec_module(importlib.util.module_from_spec(spec))' "$ext" ||
        { echo "device-amx: $(basename "$ext") does not load with $py" >&2; return 1; }
    echo "device-amx: $(basename "$ext") loads with CPython $v ($py)"
}

# pack_perf: this machine's `perf` with the libraries it links beyond glibc's, compressed into
# .dev/perf.tar.xz (the device has no perf); none if this machine has none.
pack_perf() {
    local perf tmp
    perf=$(command -v perf) || { echo "device-amx: no perf here, so no profile phase there"; return 0; }
    tmp=$(mktemp -d)
    mkdir "$tmp/lib" && cp -L "$perf" "$tmp/perf"
    ldd "$perf" | awk '$3 ~ /^\// {print $3}' | grep -v -E '/(libc|libm|libpthread|libdl|librt|libresolv)\.so' |
        while read -r l; do cp -L "$l" "$tmp/lib/"; done
    tar -C "$tmp" -cJf "$dev/perf.tar.xz" . && rm -rf "$tmp"
}

log() { echo "$*" | tee -a "$out/log.txt"; }

# step NAME SECONDS CMD...: CMD (a program, or one of the functions here) with its output in
# the log, unless fewer than SECONDS are left before the deadline.
step() {
    local name=$1 need=$2
    shift 2
    local left=$((deadline - SECONDS))
    if [ "$left" -lt "$need" ]; then
        log "== $name: skipped, ${left}s left of the deadline (needs ~${need}s)"
        return 0
    fi
    log "== $name ($(date +%T))"
    if declare -F "$1" > /dev/null; then
        "$@"
    else
        timeout "$left" "$@" 2>&1 | tee -a "$out/log.txt" | tail -n 3 || log "== $name: exit ${PIPESTATUS[0]}"
    fi
}

# bench FILE ENV... -- ARGS...: one `kt bench --json` run appended to FILE (a JSON list).
bench() {
    local file=$1 envs=() label=() j
    shift
    # NAME= (empty) unsets NAME: the default.
    while [ "$1" != "--" ]; do
        if [ -n "${1#*=}" ]; then envs+=("$1"); else envs+=(-u "${1%=}"); fi
        label+=("$1")
        shift
    done
    shift
    j=$(env "${envs[@]}" timeout $((deadline - SECONDS)) "$dev/bin/kt" bench --json "$@" 2>>"$out/log.txt") ||
        { log "  kt bench $* failed or ran out of time"; return 0; }
    python3 - "$file" "$j" "${label[*]}" <<'EOF' | tee -a "$out/log.txt"
import json, os, sys
path, run, env = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3]
runs = json.load(open(path)) if os.path.exists(path) else []
run["env"] = env
runs.append(run)
json.dump(runs, open(path, "w"))
print("  " + " ".join(f"{r['method']}/{r['backend']}/n{r['tokens']}={r['ms_best']:.2f}" for r in run["results"]))
EOF
}

phase_tests() {
    # Every ISA this machine has is required: a tile test that skips fails.
    export KT_REQUIRE_ISA=avx2,avx512,amx
    for t in "$dev"/bin/test-kt_backend_amx "$dev"/bin/test-kt_backend_llamafile "$dev"/bin/test-kt_fixtures; do
        [ -x "$t" ] || { log "no $t"; continue; }
        case $t in
            *llamafile) step "$(basename "$t")" 60 "$t" tiles conformance ;;
            *) step "$(basename "$t")" 60 "$t" ;;
        esac
    done
}

phase_tile_from() {
    local methods from
    # Each list on tiles and off before the next, so a deadline cuts whole pairs.
    for methods in "$UNMEASURED" "$KT_FORMATS" "$GGUF_TYPES"; do
        for from in 1 100000; do
            step "tile-from $methods, KT_AMX_TILE_FROM=$from" 60 bench "$out/tile_from.json" KT_AMX_TILE_FROM=$from -- \
                --method "$methods" --tokens 16,32,64,128,256 --threads 2 --min-time 0.3
        done
    done
}

phase_gguf() {
    for from in 100000 2; do
        step "gguf n=512,2048, KT_AMX_TILE_FROM=$from" 90 bench "$out/gguf.json" KT_AMX_TILE_FROM=$from -- \
            --method "$GGUF_TYPES" --tokens 512,2048 --threads 2 --min-time 0.3
    done
}

phase_tables() {
    for threads in 2 16; do
        for v in "" avx512; do
            step "tables ${v:-amx}, $threads threads" 60 bench "$out/tables.json" KT_KERNEL_CPU_VARIANT=$v -- \
                --method "$KT_FORMATS" --tokens 1,4,256,1024 --threads $threads --min-time 0.3
        done
    done
}

phase_kt() {
    local ext
    ext=$dev/kt/_kt_kernel_ext_amx$(python3 -c 'import sysconfig; print(sysconfig.get_config_var("EXT_SUFFIX"))')
    [ -e "$ext" ] || { log "kt: no KT extension for $(python3 -V) in .dev/kt (prepare with DEVICE_PY)"; return 0; }
    for threads in 2 16; do
        for m in AMXINT8 AMXINT4 BF16 FP8 RAWINT4; do
            step "KT $m, $threads threads" 30 python3 "$here/peers/kt_moe.py" "$ext" --method $m \
                --threads $threads --tokens 1,4,256,1024
        done
    done
    grep -E "^KT " "$out/log.txt" > "$out/kt.txt" || true
}

phase_decode() {
    for threads in 2 16; do
        step "decode against a paired stream, $threads threads" 45 bench "$out/decode.json" -- \
            --method mxfp4,mxfp8,int4,bf16 --tokens 1,4 --threads $threads --min-time 0.3
    done
    # Where 16 threads lose what 2 do not at one token: the forward's stages.
    step "decode stages, 16 threads" 30 bench "$out/stages.json" -- \
        --method int4,mxfp4,bf16 --tokens 1,4 --threads 16 --min-time 0.3 --stages
}

# profile FORMAT [VAR=VALUE...]: a flat `perf` profile (cpu-clock samples by symbol) of FORMAT
# at n = 1024 on 2 threads with the variables given, its weights built and quantized first
# (their symbols show apart).
profile() {
    local p=/tmp/kt-perf m=$1
    shift
    [ -x $p/perf ] || { mkdir -p $p && tar -C $p -xJf "$dev/perf.tar.xz"; }
    LD_LIBRARY_PATH=$p/lib $p/perf record -e cpu-clock -F 1999 -q -o /tmp/perf.data -- \
        env LD_LIBRARY_PATH="$LD_LIBRARY_PATH" "$@" "$dev/bin/kt" bench --method "$m" --tokens 1024 --threads 2 \
        --min-time 5 > /dev/null 2>> "$out/log.txt" || { log "  perf record failed (exit $?)"; return 0; }
    { echo "### $m $*, n = 1024, 2 threads"; LD_LIBRARY_PATH=$p/lib $p/perf report -i /tmp/perf.data --stdio \
        --sort sym --percent-limit 0.5 2> /dev/null | grep -v -e '^#' -e '^$' | head -40; echo; } | tee -a "$out/profile.txt"
}

phase_profile() {
    [ -f "$dev/perf.tar.xz" ] || { log "no perf in .dev (prepare on a machine with perf)"; return 0; }
    for m in int8 int4 fp8; do
        step "profile $m" 45 profile $m
    done
    step "profile q4_0 on tiles" 45 profile q4_0 KT_AMX_TILE_FROM=2
}

phase_floor() {
    [ -x "$dev/bin/kt-floor" ] || { log "no $dev/bin/kt-floor (prepare)"; return 0; }
    step "floor: the tile path without its products, 2 threads" 90 sh -c "'$dev/bin/kt-floor' bench \
        --method int8,int4,bf16,fp8,mxfp8 --tokens 256,1024 --threads 2 --min-time 0.3 | tee '$out/floor.txt'"
}

phase_gemm() {
    [ -x "$dev/bin/bench-gemm" ] || { log "no $dev/bin/bench-gemm (prepare)"; return 0; }
    step "hot-weight GEMM (divan, one thread)" 60 sh -c "'$dev/bin/bench-gemm' --bench > '$out/gemm.txt' 2>&1; cat '$out/gemm.txt'"
}

run() {
    out=${OUT:-$root/.dev/out}
    mkdir -p "$out"
    deadline=$((SECONDS + ${DEADLINE_S:-540}))
    export LD_LIBRARY_PATH=$dev/lib:$dev/kt/kt_kernel.libs${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
    # KT's fixtures test reads files beside the checkout it was built in.
    [ -e /work/main ] || { mkdir -p /work && ln -s "$root" /work/main; } 2>/dev/null || true
    log "== machine: $(nproc) CPUs, $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2-)"
    log "   AMX flags: $(grep -m1 -o -w 'amx_[a-z0-9]*' /proc/cpuinfo | sort -u | tr '\n' ' ')"
    local phases=("$@")
    [ ${#phases[@]} -gt 0 ] || phases=(tests kt gguf profile floor tables decode tile-from gemm)
    for p in "${phases[@]}"; do
        declare -F "phase_${p//-/_}" > /dev/null || { log "device-amx: no phase $p (tests, kt, gguf, profile, floor, tables, decode, tile-from, gemm)"; exit 2; }
    done
    for p in "${phases[@]}"; do "phase_${p//-/_}"; done
    summary "$out" | tee "$out/summary.md"
}

summary() {
    python3 - "$1" <<'EOF'
import json, os, sys
from collections import defaultdict
d = sys.argv[1]
def runs(name):
    p = os.path.join(d, name)
    return json.load(open(p)) if os.path.exists(p) else []
def results(name):
    for run in runs(name):
        for r in run["results"]:
            yield run["env"], r
# The thresholds: per format and n, tiles always against never, and the smallest n from which
# tiles win at every larger n (n·k/E tokens an expert on average).
t = defaultdict(dict)
for env, r in results("tile_from.json"):
    t[r["method"]][(r["tokens"], "tiles" if "KT_AMX_TILE_FROM=1" in env.split() else "off")] = r["ms_best"]
if t:
    print("## Tile threshold crossover (2 threads, best ms: tiles always / never)\n")
    ns = sorted({n for m in t.values() for n, _ in m})
    print("| format | " + " | ".join(f"n={n}" for n in ns) + " | tiles win from n |")
    print("|---" * (len(ns) + 2) + "|")
    for m, v in t.items():
        cells, win = [], None
        for n in ns:
            a, b = v.get((n, "tiles")), v.get((n, "off"))
            cells.append(f"{a:.2f} / {b:.2f}" if a and b else "-")
            win = n if a and b and a < b and win is None else (None if a and b and a >= b else win)
        print(f"| {m} | " + " | ".join(cells) + f" | {win or '-'} |")
    print()
for name, title in (("gguf.json", "GGUF prefill (2 threads): off / tiles from 2 tokens"), ("tables.json", "AMX table: best ms (roof×)")):
    rows = defaultdict(dict)
    for env, r in results(name):
        rows[(r["method"], r["backend"], r["threads"], env)][r["tokens"]] = (r["ms_best"], r["roofline_ratio"])
    if rows:
        print(f"## {title}\n")
        for (m, b, th, env), v in sorted(rows.items()):
            print(f"- {m} {b} {th} thr [{env}]: " + ", ".join(f"n={n} {ms:.2f} ({x:.2f})" for n, (ms, x) in sorted(v.items())))
        print()
dec = defaultdict(dict)
for env, r in results("decode.json"):
    dec[(r["method"], r["backend"], r["threads"])][r["tokens"]] = (r["ms_best"], r["stream_ratio"], r["dram_ratio"])
if dec:
    print("## Decode: best ms (stream×, DRAM×)\n")
    for (m, b, th), v in sorted(dec.items()):
        print(f"- {m} {b} {th} thr: " + ", ".join(f"n={n} {ms:.2f} ({s if s is None else round(s, 2)}, {x:.2f})" for n, (ms, s, x) in sorted(v.items())))
    print()
st = list(results("stages.json"))
if st:
    print("## Decode stages, 16 threads (median µs a forward)\n")
    for env, r in st:
        print(f"- {r['method']} {r['backend']} n={r['tokens']} ({r['ms_best'] * 1e3:.0f} µs best): "
              + ", ".join(f"{s['stage']} {s['ms'] * 1e3:.1f}" for s in r.get("stages_ms", [])))
    print()
gemm = os.path.join(d, "gemm.txt")
if os.path.exists(gemm):
    print("## Hot-weight GEMM (one thread; Gitem/s over the peak's is the ratio)\n")
    print("```\n" + open(gemm).read().strip() + "\n```\n")
kt = os.path.join(d, "kt.txt")
if os.path.exists(kt):
    print("## KT-Kernel 0.7.2 AMX build\n")
    print(open(kt).read())
EOF
}

case ${1:-} in
    prepare) prepare ;;
    run) shift; run "$@" ;;
    summary) summary "${2:?the output folder of a run}" ;;
    *) sed -n '2,20p' "$0"; exit 2 ;;
esac
