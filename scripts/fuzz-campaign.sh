#!/usr/bin/env bash
# The fuzz campaign of docs/reliability.md: every target under cargo-fuzz's default
# AddressSanitizer for a million executions (FUZZ_RUNS), one after the other, starting from the
# committed corpus and the seeds (fuzz/seeds/<target>: files written by gguf-py, the safetensors
# package and kt convert); then each corpus minimized (cargo fuzz cmin) and the
# line coverage of the minimized corpus measured (cargo fuzz coverage + llvm-cov; needs
# `rustup component add llvm-tools`). Logs in target/fuzz-campaign/. Takes about an hour on two
# cores; scripts/test.sh runs only short smoke runs. FUZZ_RUNS=0 skips the runs (minimize and
# measure coverage only).
set -euo pipefail
cd "$(dirname "$0")/../fuzz"
export RUSTC_BOOTSTRAP=1 # cargo-fuzz's sanitizer flags need it on a stable toolchain
runs=${FUZZ_RUNS:-1000000}
targets=("$@")
[ ${#targets[@]} -gt 0 ] || targets=(quantize routing checkpoint gguf)
logs=../target/fuzz-campaign
mkdir -p "$logs"
if [ "$runs" != 0 ]; then
    for t in "${targets[@]}"; do
        extra=()
        [ -d "seeds/$t" ] && extra=("seeds/$t")
        mkdir -p "corpus/$t"
        start=$(date +%s)
        cargo fuzz run -O "$t" "corpus/$t" "${extra[@]}" -- -runs="$runs" -print_final_stats=1 > "$logs/$t.log" 2>&1
        echo "$t: $(grep -o 'number_of_executed_units: *[0-9]*' "$logs/$t.log" | grep -o '[0-9]*$') executions in $(( $(date +%s) - start )) s, $(ls ../fuzz/artifacts/$t 2>/dev/null | wc -l) crash file(s)"
    done
fi
# The sources each target is for: its coverage is reported over them as well as over all of
# this project's code linked into it.
declare -A focus=(
    [quantize]="core/src/format core/src/dtype"
    [routing]="core/src/forward.rs core/src/plan.rs core/src/routing.rs core/src/reference"
    [checkpoint]="host/src/weights core/src/format/kt_packed.rs"
    [gguf]="host/src/gguf core/src/ggml"
)
llvm_cov=$(ls "$(rustc --print sysroot)"/lib/rustlib/*/bin/llvm-cov)
lines() { tail -1 | awk '{print $(NF-3) " of " $(NF-5) " lines"}'; }
for t in "${targets[@]}"; do
    cargo fuzz cmin -O "$t" "corpus/$t" > "$logs/$t.cmin.log" 2>&1
    cargo fuzz coverage "$t" "corpus/$t" > "$logs/$t.cov.log" 2>&1
    bin=target/x86_64-unknown-linux-gnu/coverage/x86_64-unknown-linux-gnu/release/$t
    report=("$llvm_cov" report "$bin" -instr-profile="coverage/$t/coverage.profdata")
    all=$("${report[@]}" -ignore-filename-regex='(\.cargo|rustc|/fuzz/)' | lines)
    # shellcheck disable=SC2086 # the focus list is word-split on purpose
    own=$("${report[@]}" $(for f in ${focus[$t]}; do echo "$PWD/../$f"; done) | lines)
    echo "$t: minimized corpus $(ls "corpus/$t" | wc -l) inputs; line coverage $own of ${focus[$t]}, $all of the project's code linked in"
done
