"""The vLLM connector tests run only where vLLM imports (the .venv-vllm that
.ci/vllm.sh builds); elsewhere each module skips with the reason."""

import os

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
