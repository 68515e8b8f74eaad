#!/usr/bin/env bash
# Build the kt_kernel wheel (maturin, abi3 for Python >= 3.10) and install it with numpy and
# pytest into the venv target/pyenv. The wheel lands in target/wheels.
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x target/pyenv/bin/python ] || python3 -m venv target/pyenv
target/pyenv/bin/pip install -q "maturin>=1.9,<2" "numpy>=1.21" pytest safetensors "gguf>=0.17"
rm -rf target/wheels
# The wheel links the system hwloc, so it is not repaired into a manylinux one: it is for this
# machine (or one with the same Debian packages).
(cd bindings/python && CARGO_TARGET_DIR="$PWD/../../target" ../../target/pyenv/bin/maturin build --release \
    --auditwheel skip -o ../../target/wheels)
target/pyenv/bin/pip install -q --force-reinstall --no-deps target/wheels/kt_kernel-*.whl
echo "installed: $(target/pyenv/bin/python -c 'import kt_kernel as k; print(k.__name__, k.__version__, k.__cpu_variant__)')"
