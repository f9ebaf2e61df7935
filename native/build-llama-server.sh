#!/bin/sh
# llama.cpp's own llama-server (and llama-quantize) for this venv, built once per llama.cpp build and cached.
#
#   native/build-llama-server.sh VENV CACHE
#
# The sources are the llama.cpp vendored in the pinned llama-cpp-python sdist (tools/server is in it); the libraries
# are that wheel's own, already installed in VENV (libllama, libggml*, libmtmd: compiled once, with the Makefile's
# flags, e.g. no AMX on x86). So this compiles only what the server adds: common, cpp-httplib, the server (about a
# third of the wheel's compile). The result (the programs and a copy of the libraries, RPATH $ORIGIN) is kept in
# CACHE/llama-server/KEY, KEY a hash of those libraries, native/llama-server/CMakeLists.txt and the compiler; it is
# copied to VENV/libexec/llama.cpp with links in VENV/bin.
set -eu
venv=$1
cache=$2
here=$(cd "$(dirname "$0")" && pwd)
py="$venv/bin/python"
libs=$("$py" -c 'import importlib.util, pathlib; print(pathlib.Path(importlib.util.find_spec("llama_cpp").origin).parent / "lib")')
version=$("$py" -c 'import importlib.metadata as m; print(m.version("llama-cpp-python"))')
key=$( (cat "$libs/libllama.so" "$libs/libggml-cpu.so" "$libs/libggml-base.so" "$here/llama-server/CMakeLists.txt"; \
        c++ --version; uname -m) | sha256sum | cut -c1-16)
out="$cache/llama-server/$key"

if [ ! -x "$out/llama-server" ]; then
    sdist="$cache/sdist/llama_cpp_python-$version.tar.gz"
    if [ ! -f "$sdist" ]; then
        mkdir -p "$cache/sdist"
        "$py" -m pip download --quiet --no-deps --no-binary :all: "llama-cpp-python==$version" -d "$cache/sdist.part"
        mv "$cache/sdist.part/llama_cpp_python-$version.tar.gz" "$sdist"
        rm -rf "$cache/sdist.part"
    fi
    work=$(mktemp -d)
    trap 'rm -rf "$work"' EXIT
    tar -xzf "$sdist" -C "$work" "llama_cpp_python-$version/vendor/llama.cpp"
    src="$work/llama_cpp_python-$version/vendor/llama.cpp"
    cmake -S "$here/llama-server" -B "$work/build" -DLLAMA_SRC="$src" -DLLAMA_LIBS="$libs" \
        $(command -v ninja >/dev/null && echo -G Ninja) >/dev/null
    cmake --build "$work/build" --target llama-server llama-quantize --parallel "$(nproc)"
    rm -rf "$out.part" && mkdir -p "$out.part"
    cp "$work/build/bin/llama-server" "$work/build/bin/llama-quantize" "$out.part/"
    for lib in libllama libggml libggml-base libggml-cpu libmtmd; do cp "$libs/$lib.so" "$out.part/$lib.so.0"; done
    rm -rf "$out" && mv "$out.part" "$out"
fi

# Into the venv: the programs and libraries side by side (RPATH $ORIGIN), linked from bin/ so they are on the PATH
# of an activated venv and found next to its python by the daemon.
rm -rf "$venv/libexec/llama.cpp" && mkdir -p "$venv/libexec"
cp -r "$out" "$venv/libexec/llama.cpp"
for prog in llama-server llama-quantize; do ln -sf "../libexec/llama.cpp/$prog" "$venv/bin/$prog"; done
"$venv/bin/llama-server" --version 2>&1 | head -1
