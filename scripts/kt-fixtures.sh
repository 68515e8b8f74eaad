#!/usr/bin/env bash
# Rewrites tests/fixtures/kt: KT-Kernel 0.7.2's own converted AMXINT8/AMXINT4 files and
# forward outputs for small layers (one K block and a short one; two NUMA parts), which
# host/tests/kt_fixtures.rs checks our bytes and outputs against. Needs an x86 CPU with AVX-512
# (KT's AMX classes run on its AVX-512 builds too; the packed bytes are the same) and downloads
# KT's wheel at run time (scripts/peers/kt_wheel.sh); the wheel is never committed.
#
#   bash scripts/kt-fixtures.sh [VARIANT]     (default: the widest of KT's builds this CPU runs)
#
# A rerun writes the same tensors and metadata; only the order of the metadata in the file's
# header varies (the safetensors writer keeps it in a hash map), so git sees the files change.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
source "$here/peers/kt_wheel.sh"
variant=${1:-}
if [ -z "$variant" ]; then
    flags=$(grep -m1 '^flags' /proc/cpuinfo)
    for v in amx:amx_int8 avx512_bf16:avx512_bf16 avx512_vbmi:avx512vbmi avx512_vnni:avx512_vnni avx512_base:avx512bw; do
        [[ " $flags " == *" ${v#*:} "* ]] && { variant=${v%%:*}; break; }
    done
fi
[ -n "$variant" ] || { echo "kt-fixtures: KT's AMX classes need AVX-512; this CPU has none" >&2; exit 1; }
python3 -c "import safetensors" 2>/dev/null || python3 -m pip install --quiet --user safetensors
ext=$(kt_wheel_ext "$variant")
out="$here/../tests/fixtures/kt"
rm -rf "$out.new" && mkdir -p "$out.new"
# KT's extension chatters on stdout: only the driver's own lines are shown.
python3 "$here/peers/kt_fixtures.py" "$ext" "$out.new" | grep '^kt-fixtures:'
chmod 644 "$out.new"/*/*.safetensors
rm -rf "$out" && mv "$out.new" "$out"
echo "kt-fixtures: wrote $(du -sh "$out" | cut -f1) under tests/fixtures/kt ($variant)"
