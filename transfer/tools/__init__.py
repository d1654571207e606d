"""Tools that drive the transfer engine alone (no engine, no cluster): the transfer
benchmark (``python -m kvferry.transfer.tools.bench_transfer``)."""
