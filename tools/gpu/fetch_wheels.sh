#!/usr/bin/env bash
# Fetch the wheels that the GPU device machine lacks (run on a machine with PyPI access, in the
# repository root), into a folder git ignores; gpu_check.py installs them there offline.
#
#   bash tools/gpu/fetch_wheels.sh [DIR]        # default DIR: .cache/gpu-wheels
#
# What is fetched (machine seen 2026-11: Python 3.12, torch 2.11, transformers 5.17, no
# pypdfium2, no datasets): pypdfium2 (raggedvl.data imports it) and the transformers this
# project pins (its other needs, huggingface_hub >= 1.31 and tokenizers 0.23, are there).
# About 18 MB; the device tool carries at most 64 MiB with the working tree. Then call the
# device tool with carry [".cache/gpu-wheels"] (see benchmarks/results/gpu_check.md).
set -euo pipefail
dir="${1:-.cache/gpu-wheels}"
pin() { grep -i "^$1==" constraints.txt | head -1; }
mkdir -p "$dir"
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d "$dir" \
  "$(pin pypdfium2)" "$(pin transformers)"
ls -l "$dir"
