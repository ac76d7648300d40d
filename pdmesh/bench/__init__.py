"""`pdmesh bench` and the benchmark helpers: load generators, workloads, the raw NATS baseline,
counters, reports and plots."""
