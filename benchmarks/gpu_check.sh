#!/usr/bin/env bash
# The whole GPU check in one command, from the repository root or anywhere:
#
#   benchmarks/gpu_check.sh [bench_gpu.py options, e.g. --contexts 8192,32768 --model PATH]
#
# 1. fails fast, with the reason, when torch sees no CUDA device or Triton is missing;
# 2. runs the CUDA tests (pytest -m cuda: the Triton kernels compiled on the GPU against the
#    torch reference, a cache on the GPU against the CPU, device bytes, no host read in a
#    decoding step);
# 3. runs benchmarks/bench_gpu.py (decode speed and peak device memory at 8K / 32K / 128K),
#    which writes its table, with the GPU's name, into benchmarks/results/.
#
# Python: $PYTHON, else the repository's .venv if its torch sees CUDA, else python3. It needs a
# CUDA build of torch, triton and this package with its test extra (pip install -e '.[test]').
# Exit status: 2 without a usable GPU; otherwise non-zero when the tests or the benchmark failed.
set -uo pipefail
cd "$(dirname "$0")/.."

if [ -z "${PYTHON:-}" ]; then
    PYTHON=python3
    if [ -x .venv/bin/python ] && .venv/bin/python -c "import torch, sys; sys.exit(not torch.cuda.is_available())" 2>/dev/null; then
        PYTHON=.venv/bin/python
    fi
fi

"$PYTHON" - <<'EOF' || exit 2
import sys
try:
    import torch
except ImportError:
    sys.exit("gpu_check: torch is not installed for this Python; install a CUDA build of torch (or set PYTHON=...)")
if not torch.cuda.is_available():
    sys.exit(f"gpu_check: no CUDA device: torch.cuda.is_available() is False (torch {torch.__version__}, "
             f"CUDA build: {torch.version.cuda or 'none, a CPU-only build'})")
try:
    import triton
except ImportError:
    sys.exit("gpu_check: triton is not installed: pip install -e '.[test]' (or pip install triton)")
try:
    import kv_cache  # noqa: F401
    import pytest  # noqa: F401
except ImportError as exc:
    sys.exit(f"gpu_check: {exc}; pip install -e '.[test]' first")
print(f"gpu_check: {torch.cuda.get_device_name(0)}, torch {torch.__version__} (CUDA {torch.version.cuda}), "
      f"triton {triton.__version__}")
EOF

status=0
echo "== CUDA tests (pytest -m cuda) =="
"$PYTHON" -m pytest -m cuda -q -o addopts=-ra tests/ || status=1
echo "== bench_gpu.py =="
"$PYTHON" benchmarks/bench_gpu.py "$@" || status=1
exit $status
