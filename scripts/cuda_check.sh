#!/usr/bin/env bash
# The prepared GPU check (CI has no GPU): runs the CUDA tests of tests/test_cuda.py plus the real
# SSD worker tests on a machine with a CUDA build of torch. Installs nothing: it uses that machine's
# python3 (torch, transformers, safetensors, tokenizers, numpy, scipy, pytest are what it needs).
#   scripts/cuda_check.sh            # from the repository root; extra args go to pytest
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
python3 -c "import torch; assert torch.cuda.is_available(), 'no CUDA GPU visible'; \
print('torch', torch.__version__, 'on', torch.cuda.get_device_name(0))"
python3 -m pytest -q -x -p no:cacheprovider -rs tests/test_cuda.py tests/test_ssd.py \
    -k "cuda or real_worker or hung" "$@"
