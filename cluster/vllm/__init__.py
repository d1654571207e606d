"""kvferry as a vLLM 0.33 KV connector (``kvferry.cluster.vllm.connector.KvferryConnector``).

Importing this package does not import vLLM; :mod:`.connector` and :mod:`.plugin` do.
See the README's section "vLLM with kvferry".
"""
