#!/usr/bin/env bash
# The Python packages that launch/device_check.sh needs and the device image lacks, as wheels
# in .whl/ (ignored by git; carried to the device machine with `carry=[".whl"]`).
#   bash launch/device_wheels.sh      # here, with the package registry reachable; ~0.2 MB
# The device image (see the device tool's KINDS.md) has jax/jaxlib with CUDA, flax, optax,
# orbax-checkpoint, chex, absl-py, numpy, scipy, matplotlib, tqdm, torch and pytest; of what
# the benchmarks import it lacks tensorboardX alone (pure Python; its needs, numpy,
# packaging and protobuf, are there).
# Expected result: .whl/tensorboardx-2.6.5-py3-none-any.whl
set -euo pipefail
cd "$(dirname "$0")/.."
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp --platform manylinux2014_x86_64 -d .whl 'tensorboardX==2.6.5'
ls .whl
