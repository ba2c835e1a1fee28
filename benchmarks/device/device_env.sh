# Sourced by the device scripts: the gguf wheel from $CARRY, and an `elesium` package shim under /tmp/p
# built from this checkout (the device machine has torch and triton but not our install).
# The wheels it lacks, fetched here with `pip download --no-deps --python-version 3.12 --platform
# manylinux_2_28_x86_64 --platform manylinux2014_x86_64 --only-binary=:all: -d .whl gguf llguidance pydantic
# pydantic-core annotated-types typing-inspection` (the engine imports llguidance and pydantic for grammars).
CARRY=${CARRY:-.lead-carry}
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT" /tmp/p/elesium
python3 -m pip install -q --no-index --no-deps --target /tmp/site "$CARRY"/*.whl >/dev/null 2>&1
cp -r elesium/* /tmp/p/elesium/
for d in inference kernels state graphs api; do rm -rf "/tmp/p/elesium/$d"; cp -r "$d" "/tmp/p/elesium/$d"; done
export PYTHONPATH=/tmp/p:/tmp/site PYTHONUNBUFFERED=1
P="$CARRY/mt_bench_questions.jsonl"
E="python3 -P -m elesium.cli"  # -P: the repo root must not shadow the shim
