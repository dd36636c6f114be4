"""The planner: a discrete-event model of an RL step under an engine cost model, so a user can see what TLT's
pieces (adaptive SD, streaming, partial rollouts, the overlapped learner) buy on a workload and hardware
before spending device-days on it.

- `lengths`: response-length distributions (a run's metrics, a short rollout's lengths, a named law);
- `acceptance`: tokens emitted per speculative round per arm and batch bucket;
- `costs`: the engine cost model's surface and the CPU model fitted on microbenchmarks;
- `roofline`: the GPU cost model from vendors' published figures and stated achieved fractions;
- `simulate`: the step simulator, with the rollout workers' and the learner's own rules;
- `project`: the modes, tables, recommendations and the paper's published setup.

Everything here is a projection: pure functions of the inputs, no I/O but reading a run directory.
"""
