#!/usr/bin/env bash
# The environment the SGLang tests run in (bindings/python/tests_sglang), kept outside the
# checkout in ${KT_SGLANG_CACHE:-~/.cache/kt-kernel-rs/sglang}: a venv with torch (PyPI's
# build; its CUDA libraries load on a CPU-only machine and stay unused) and what SGLang's
# modules import, and SGLang's own code from its PyPI wheels, unpacked side by side (both are
# the package `sglang`, so each test run puts one first on sys.path): upstream/ from
# sglang 0.5.23, fork/ from KT's fork sglang-kt 0.7.2. Nothing of it is committed. Installs
# our wheel from target/wheels (scripts/python.sh builds it). A second run only reinstalls it.
set -euo pipefail
cd "$(dirname "$0")/.."
cache=${KT_SGLANG_CACHE:-$HOME/.cache/kt-kernel-rs/sglang}
mkdir -p "$cache"
# torch and what `import sglang.srt.layers.moe.kt_ep_wrapper` pulls in (found by importing it),
# pinned to the versions this was written against. sgl_kernel (GPU kernels) is not among them:
# the tests stand in for it.
pins=(torch==2.15.0 torchvision==0.29.2 numpy==2.4.6 safetensors==0.8.0 pytest==9.2.0
    transformers==5.24.0 compressed-tensors==0.20.0 gguf==0.19.0 sentencepiece==0.2.3
    apache-tvm-ffi==0.1.15.post2 orjson==3.13.0 psutil==7.2.2 pybase64==1.5.1 requests==2.34.2
    packaging==26.4 pillow==13.0.0 starlette==1.10.0 msgspec==0.22.0 pydantic==2.14.4
    pyzmq==27.3.0 tqdm==4.70.1 ipython==9.18.1 aiohttp==3.14.5 dill==0.4.1 jsonschema==4.26.0
    openai==3.57.0 partial-json-parser==0.2.1.1.post7 einops==0.8.2)
stamp="${pins[*]}"
if [ "$(cat "$cache/env.stamp" 2>/dev/null)" != "$stamp" ]; then
    echo "sglang-env: installing torch and SGLang's imports into $cache/env (about 6 GB, once)" >&2
    rm -rf "$cache/env"
    python3 -m venv "$cache/env"
    "$cache/env/bin/pip" install -q "${pins[@]}"
    echo "$stamp" > "$cache/env.stamp"
fi
for spec in upstream:sglang==0.5.23 fork:sglang-kt==0.7.2; do
    dir=$cache/${spec%%:*}
    [ -f "$dir/sglang/srt/layers/moe/kt_ep_wrapper.py" ] && continue
    rm -rf "$dir" "$cache/dl" && mkdir -p "$dir" "$cache/dl"
    "$cache/env/bin/pip" download -q --no-deps -d "$cache/dl" "${spec#*:}"
    "$cache/env/bin/python" -m zipfile -e "$cache"/dl/*.whl "$dir"
    rm -rf "$cache/dl"
done
"$cache/env/bin/pip" install -q --force-reinstall --no-deps target/wheels/kt_kernel-*.whl
echo "$cache"
