"""Tools that drive one rank's engine parts alone, with no cluster: the GPU check and its
tuning sweep (``gpu_check``, ``gpu_tune``), and the checksum and reshard benchmarks
(``bench_checksum``, ``bench_reshard``). Each runs with ``python -m
kvferry.engine.tools.<name>`` and has a wrapper in ``scripts/``."""
