"""Measurement and fault injection, in rooms: the kill harness (``kills``), the bench (``bench``),
the GPU check (``gpu``), the simulator (``simulator``); beside them what all of them use: the
workloads and their data, the fork server, what a machine is, plotting, and Checkflow's profile."""
