#!/usr/bin/env bash
# SGLang's own KT integration code against this package (bindings/python/tests_sglang): the
# environment from scripts/sglang-env.sh, then one pytest run per SGLang tree (both are the
# package `sglang`); then the tests that need torch itself (bindings/python/tests_torch:
# kt_kernel.sft in torch's autograd). Needs target/wheels from scripts/python.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
# The environment takes about 6 GB once: on a machine without the room, say so and skip.
export KT_SGLANG_CACHE=${KT_SGLANG_CACHE:-$HOME/.cache/kt-kernel-rs/sglang}
cache=$KT_SGLANG_CACHE
mkdir -p "$cache"
free_gb=$(df -Pk "$cache" | awk 'NR == 2 { print int($4 / 1048576) }')
if [ ! -f "$cache/env.stamp" ] && [ "$free_gb" -lt 10 ]; then
    echo "skipped: the SGLang and torch tests need about 6 GB for torch and SGLang's imports; $cache has ${free_gb} GB free"
    exit 0
fi
bash scripts/sglang-env.sh >/dev/null
for tree in upstream fork; do
    echo "-- sglang tests against $tree ($cache/$tree)"
    (cd bindings/python/tests_sglang && KT_SGLANG_ROOT="$cache/$tree" "$cache/env/bin/python" -m pytest -q -p no:cacheprovider -W ignore::UserWarning "test_$tree.py")
done
echo "-- kt_kernel.sft with torch (bindings/python/tests_torch)"
(cd bindings/python/tests_torch && "$cache/env/bin/python" -m pytest -q -p no:cacheprovider)
