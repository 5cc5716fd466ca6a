#!/usr/bin/env bash
# Build llama.cpp's converter and CPU tools once, from PyPI's llama-cpp-python source distribution.
#
#   scripts/build_llamacpp.sh DEST VERSION PYTHON
#
# DEST gets (only when everything succeeded; built in DEST.tmp.* and renamed into place):
#   bin/llama-completion, bin/llama-perplexity, bin/llama-quantize, bin/llama-imatrix, bin/llama-bench
#                                                  (statically linked to llama.cpp, CPU only)
#   convert/convert_hf_to_gguf.py, convert/conversion/, convert/gguf-py/, convert/models/templates/
#   BUILD_INFO (version, llama.cpp commit, cmake flags, seconds)
# The converter and the tools come from the same vendored llama.cpp commit, so the GGUF the converter writes
# is one the runtime was written for. The source distribution is the only download (pip, PyPI; ~73 MB).
#
# Portability vs speed: GGML_NATIVE=OFF builds for x86-64 with SSE4.2/AVX/AVX2/FMA/F16C/BMI2 (x86-64-v3: Intel
# since Haswell, AMD since Zen), not for this machine's AVX-512, so a cache copied to another CPU still runs.
# Time: 672 s for two tools, 1382 s for all five on 2 shared cores here (BUILD_INFO records it); libllama, ggml
# and common dominate, each tool adds a source file or two and a link of its own (7-11 MB, static).
#
# A cache whose BUILD_INFO lists other targets (an older build with fewer tools) is stale: it is rebuilt, and
# replaced only once the new build has succeeded. `make llamacpp` always runs this script, so it decides.
set -euo pipefail

dest=${1:?usage: build_llamacpp.sh DEST VERSION PYTHON}
version=${2:?usage: build_llamacpp.sh DEST VERSION PYTHON}
python=${3:?usage: build_llamacpp.sh DEST VERSION PYTHON}
jobs=${LLAMACPP_JOBS:-2}
# Only what ghosted_core.export runs: greedy generation, perplexity, the k-quants (llama-quantize, from an
# f16 GGUF, optionally with an importance matrix from llama-imatrix) and speed (llama-bench). Keep this list
# equal to ghosted_core.export.llamacpp.TOOLS.
targets=(llama-completion llama-perplexity llama-quantize llama-imatrix llama-bench)

if [ -f "$dest/BUILD_INFO" ]; then
    built=$(sed -n 's/^targets //p' "$dest/BUILD_INFO")
    if [ "$built" = "${targets[*]}" ]; then
        echo "llama.cpp $version already built in $dest"
        exit 0
    fi
    echo "llama.cpp: $dest has '${built}', not '${targets[*]}': rebuilding (the old build stays until this succeeds)"
fi
for tool in cmake ninja c++; do
    command -v "$tool" >/dev/null || { echo "build_llamacpp.sh: '$tool' is missing (apt-get install cmake ninja-build g++)" >&2; exit 2; }
done

mkdir -p "$(dirname "$dest")"
work=$(mktemp -d "$dest.tmp.XXXXXX")
trap 'rm -rf "$work"' EXIT
start=$(date +%s)

echo "llama.cpp: downloading llama-cpp-python==$version (source distribution, PyPI)"
"$python" -m pip download --quiet --no-deps --no-binary :all: "llama-cpp-python==$version" -d "$work/dl"
sdist=$(ls "$work"/dl/llama_cpp_python-"$version".tar.gz)
top="llama_cpp_python-$version/vendor/llama.cpp"
# Docs, media, benches and the tokenizer test vocabularies (75 MB) are not needed to build or convert.
tar xzf "$sdist" -C "$work" \
    --exclude="$top/docs" --exclude="$top/media" --exclude="$top/benches" \
    --exclude="$top/models/ggml-vocab-*" "$top" "llama_cpp_python-$version/CHANGELOG.md"
src="$work/$top"
# The sdist has no .git: its changelog names the vendored commit ("update llama.cpp to ggml-org/llama.cpp@HASH").
commit=$(grep -m1 -o 'llama\.cpp@[0-9a-f]*' "$work/llama_cpp_python-$version/CHANGELOG.md" | cut -d@ -f2 || true)
rm -f "$sdist"

flags=(
    -G Ninja
    -DCMAKE_BUILD_TYPE=Release
    -DBUILD_SHARED_LIBS=OFF
    -DGGML_NATIVE=OFF
    -DLLAMA_BUILD_TESTS=OFF
    -DLLAMA_BUILD_EXAMPLES=OFF
    -DLLAMA_BUILD_SERVER=OFF
    -DLLAMA_BUILD_APP=OFF
    -DLLAMA_OPENSSL=OFF
    "-DLLAMA_BUILD_COMMIT=${commit:-unknown}"
)
echo "llama.cpp: configuring (commit ${commit:-unknown})"
cmake -S "$src" -B "$work/build" "${flags[@]}" >"$work/cmake.log" 2>&1 || { tail -30 "$work/cmake.log" >&2; exit 1; }
echo "llama.cpp: building ${targets[*]} with -j$jobs"
cmake --build "$work/build" -j "$jobs" --target "${targets[@]}" >"$work/build.log" 2>&1 || { tail -40 "$work/build.log" >&2; exit 1; }

out="$work/out"
mkdir -p "$out/bin" "$out/convert/models"
for t in "${targets[@]}"; do
    install -m 755 "$work/build/bin/$t" "$out/bin/$t"
done
cp -r "$src/convert_hf_to_gguf.py" "$src/conversion" "$src/gguf-py" "$out/convert/"
cp -r "$src/models/templates" "$out/convert/models/"
cp "$src/LICENSE" "$out/LICENSE"
"$out/bin/llama-completion" --version >/dev/null 2>&1 || { echo "build_llamacpp.sh: the built llama-completion does not run" >&2; exit 1; }

seconds=$(( $(date +%s) - start ))
{
    echo "llama-cpp-python $version"
    echo "llama.cpp $commit"
    echo "cmake ${flags[*]}"
    echo "targets ${targets[*]}"
    echo "seconds $seconds"
} >"$out/BUILD_INFO"
rm -rf "$dest"  # a folder without BUILD_INFO is an unfinished copy
mv "$out" "$dest"
echo "llama.cpp $version built in ${seconds}s into $dest ($(du -sh "$dest" | cut -f1))"
