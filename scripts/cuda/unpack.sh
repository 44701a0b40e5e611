#!/usr/bin/env bash
# On a GPU machine: unpacks the bundle scripts/cuda/build.sh --bundle wrote (carry/cuda) to
# /tmp/peregrine-cuda and prints the line to source for running it.
# usage: source scripts/cuda/unpack.sh   (then `peregrine` is on PATH)
set -e
dir=/tmp/peregrine-cuda
mkdir -p "$dir"
here=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
xz -dc "$here/carry/cuda/peregrine.xz" > "$dir/peregrine"
chmod +x "$dir/peregrine"
cp "$here/carry/cuda/libcudart.so.13" "$dir/"
export PATH=$dir:$PATH LD_LIBRARY_PATH=$dir:/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
set +e
