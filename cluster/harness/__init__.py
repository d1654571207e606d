"""The harness: everything that drives, loads, breaks or measures a kvferry cluster from outside.

The fault suite, the soak, the workload generator, local clusters (every role as a process
on this host), network namespaces for multi-node runs on one machine, and every benchmark
(transfer, protocol, abort, long context). Nothing in the service (``kvferry.cluster``
outside this package, ``kvferry.engine``, ``kvferry.transfer``) imports it;
``tests/cluster/test_layout.py`` checks that.
"""
