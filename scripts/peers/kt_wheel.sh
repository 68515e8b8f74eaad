# Sourced by the scripts that run KT-Kernel's own code: kt_wheel_ext VARIANT prints the path of
# the wheel's `_kt_kernel_ext_<VARIANT>` extension, downloading kt-kernel==$KT_VERSION (~100 MB)
# into $KT_PEER_CACHE (~/.cache/kt-peer) on first use. Never committed; numpy is installed for
# the Python drivers if missing.
KT_VERSION=0.7.2
kt_wheel_ext() {
    local variant=$1 cache=${KT_PEER_CACHE:-$HOME/.cache/kt-peer} wheel py ext
    python3 -c "import numpy" 2>/dev/null || python3 -m pip install --quiet --user numpy >&2
    mkdir -p "$cache"
    wheel=$(ls "$cache"/kt_kernel-$KT_VERSION-*.whl 2>/dev/null | head -1 || true)
    if [ -z "$wheel" ]; then
        py=$(python3 -c 'import sys; print(f"{sys.version_info[0]}{sys.version_info[1]}")')
        python3 -m pip download --quiet --no-deps --only-binary=:all: --python-version "$py" \
            --platform manylinux_2_35_x86_64 -d "$cache" "kt-kernel==$KT_VERSION" >&2
        wheel=$(ls "$cache"/kt_kernel-$KT_VERSION-*.whl | head -1)
    fi
    [ -d "$cache/unpacked/kt_kernel" ] || unzip -q -o "$wheel" 'kt_kernel/*' 'kt_kernel.libs/*' -d "$cache/unpacked"
    ext=$(ls "$cache"/unpacked/kt_kernel/_kt_kernel_ext_"$variant".*.so 2>/dev/null | head -1 || true)
    [ -n "$ext" ] || { echo "the KT wheel has no $variant extension" >&2; return 1; }
    echo "$ext"
}
