#!/usr/bin/env bash
# SGLang's own KT integration code against this package (bindings/python/tests_sglang): the
# environment from scripts/sglang-env.sh, then one pytest run per SGLang tree (both are the
# package `sglang`). Needs target/wheels from scripts/python.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
cache=$(bash scripts/sglang-env.sh | tail -1)
for tree in upstream fork; do
    echo "-- sglang tests against $tree ($cache/$tree)"
    (cd bindings/python/tests_sglang && KT_SGLANG_ROOT="$cache/$tree" "$cache/env/bin/python" -m pytest -q -p no:cacheprovider -W ignore::UserWarning "test_$tree.py")
done
