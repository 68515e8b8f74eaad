#!/usr/bin/env bash
# SGLang's own KT integration code against this package (bindings/python/tests_sglang): the
# environment from scripts/sglang-env.sh, then one pytest run per SGLang tree (both are the
# package `sglang`). Needs target/wheels from scripts/python.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
# The environment takes about 6 GB once: on a machine without the room, say so and skip.
cache_root=${KT_SGLANG_CACHE:-$HOME/.cache/kt-kernel-rs/sglang}
mkdir -p "$cache_root"
free_gb=$(df -Pk "$cache_root" | awk 'NR == 2 { print int($4 / 1048576) }')
if [ ! -f "$cache_root/env.stamp" ] && [ "$free_gb" -lt 10 ]; then
    echo "skipped: the SGLang tests need about 6 GB for torch and SGLang's imports; $cache_root has ${free_gb} GB free"
    exit 0
fi
cache=$(bash scripts/sglang-env.sh | tail -1)
for tree in upstream fork; do
    echo "-- sglang tests against $tree ($cache/$tree)"
    (cd bindings/python/tests_sglang && KT_SGLANG_ROOT="$cache/$tree" "$cache/env/bin/python" -m pytest -q -p no:cacheprovider -W ignore::UserWarning "test_$tree.py")
done
