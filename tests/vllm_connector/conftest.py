"""The vLLM connector tests run only where vLLM imports (the .venv-vllm that
.ci/vllm.sh builds); elsewhere each module skips with the reason.

Every engine the cases start holds one handshake secret, from the environment (the
prefill processes inherit it); a case that wants another gives its engine a
``secret_file``, which wins over the environment."""

import os

from kvferry.cluster.trust import SECRET_ENV, generate_secret

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault(SECRET_ENV, generate_secret())
