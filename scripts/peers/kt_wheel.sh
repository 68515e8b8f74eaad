# Sourced by the scripts that run KT-Kernel's own code: kt_wheel_ext VARIANT [PY] prints the path
# of the wheel's `_kt_kernel_ext_<VARIANT>` extension for CPython PY (312 for 3.12; default this
# machine's python3), downloading kt-kernel==$KT_VERSION (~100 MB) into $KT_PEER_CACHE
# (~/.cache/kt-peer) on first use and unpacking it into `unpacked` there (another Python's into
# `unpacked-cpPY`). Never committed; numpy is installed for the Python drivers if missing.
KT_VERSION=0.7.2
kt_wheel_ext() {
    local variant=$1 here_py cache=${KT_PEER_CACHE:-$HOME/.cache/kt-peer} py dir wheel ext
    here_py=$(python3 -c 'import sys; print(f"{sys.version_info[0]}{sys.version_info[1]}")')
    py=${2:-$here_py}
    dir=$cache/unpacked
    [ "$py" = "$here_py" ] || dir=$cache/unpacked-cp$py
    python3 -c "import numpy" 2>/dev/null || python3 -m pip install --quiet --user numpy >&2
    mkdir -p "$cache"
    wheel=$(ls "$cache"/kt_kernel-$KT_VERSION-cp$py-*.whl 2>/dev/null | head -1 || true)
    if [ -z "$wheel" ]; then
        python3 -m pip download --quiet --no-deps --only-binary=:all: --python-version "$py" \
            --platform manylinux_2_35_x86_64 -d "$cache" "kt-kernel==$KT_VERSION" >&2
        wheel=$(ls "$cache"/kt_kernel-$KT_VERSION-cp$py-*.whl | head -1)
    fi
    [ -d "$dir/kt_kernel" ] || unzip -q -o "$wheel" 'kt_kernel/*' 'kt_kernel.libs/*' -d "$dir"
    ext=$(ls "$dir"/kt_kernel/_kt_kernel_ext_"$variant".*.so 2>/dev/null | head -1 || true)
    [ -n "$ext" ] || { echo "the KT wheel has no $variant extension" >&2; return 1; }
    echo "$ext"
}
