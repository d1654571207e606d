"""A discrete-event simulation of the abort protocol at scale, with the production code.

Every simulated rank is the service's own decode or prefill rank class, with its real
page allocator, running the protocol core's tables (:mod:`kvferry.engine.protocol`);
only time and the network are simulated. Modules, one job each:

- :mod:`.clock`: the event queue and the simulated clock;
- :mod:`.network`: per-hop latency (measured on this machine, or a datacentre's), loss,
  duplication, reordering, rack partitions, one-sided writes over a link's bandwidth;
- :mod:`.ranks`: the runtime the ranks run on, and the ranks themselves;
- :mod:`.service`: the ranks' own time: each rank a single server, a service time per
  message, decode steps and computes that occupy it (``--no-service-model`` turns it
  off), with the figures measured on this machine by :mod:`.calibrate`;
- :mod:`.router`: admission, placement, the abort fan-out and the client's answer;
- :mod:`.truth`: the ground truth of every write, and the safety checks off it;
- :mod:`.scenarios`: the workloads and faults (steady, storm, partition, partition-long,
  crash, slow);
- :mod:`.world`: one fleet, its faults and its run;
- :mod:`.metrics`: what a run reports, as JSON and as a table;
- :mod:`.validate`: the 1x1 and 2x2 cases against the real local cluster (bench-abort);
- :mod:`.cli`: ``python -m kvferry.cluster.harness.simulate`` (``scripts/simulate.sh``).
"""
