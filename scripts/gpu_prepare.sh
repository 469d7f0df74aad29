#!/usr/bin/env bash
# Before a GPU session's first device call (docs/GPU.md, "A GPU session"): what the device machine
# lacks, laid in the repository under git-ignored folders for `run`'s carry:
#   .whl/          wheels of the packages its image does not hold (it reaches no package index), for
#                  its Python (3.12, x86_64), without their dependencies (the image has those);
#   .shared_copy/  ../shared (only the repository travels; the suite reads ../shared's checkpoint).
# About 25 MB in all (the 64 MiB a call carries includes the tracked tree, ~3 MB).
#
#   scripts/gpu_prepare.sh                 # then: run(carry=[".whl", ".shared_copy"], ...)
#   DEVICE_PYTHON=3.12 scripts/gpu_prepare.sh
set -eu
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
[ -x "$PY" ] || PY=python3
DEVICE_PYTHON=${DEVICE_PYTHON:-3.12}
# Not in the device image (docs/GPU.md): the engine's (pulp, gguf), the test extras' (compressed-tensors
# and loguru; the server's fastapi, uvicorn, multipart, httptools, openai; xgrammar, jsonschema), pydantic
# for those, and FlexGen 0.1.8 itself, the baseline.
PACKAGES=("pulp>=2.7,<4" "gguf>=0.10" "compressed-tensors>=0.20" loguru pydantic pydantic-core annotated-types
          typing-inspection fastapi starlette uvicorn python-multipart httptools openai distro jiter sniffio
          "xgrammar>=0.1.25" jsonschema jsonschema-specifications referencing rpds-py "flexgen==0.1.8")
rm -rf .whl
mkdir -p .whl
"$PY" -m pip download -q --no-deps --only-binary=:all: --implementation cp --python-version "$DEVICE_PYTHON" \
    --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 \
    -d .whl "${PACKAGES[@]}"
rm -rf .shared_copy
if [ -d ../shared ]; then
    cp -r ../shared .shared_copy
    chmod -R u+w .shared_copy  # CI's copy has no write bits; the device's ../shared is made from this
fi
echo "$(ls .whl | wc -l) wheels in .whl ($(du -sh .whl | cut -f1)); .shared_copy: $(du -sh .shared_copy 2>/dev/null | cut -f1)"
