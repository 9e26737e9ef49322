"""``everystep bench``: every strategy, baseline and library on one workload, interleaved — the
command, one measured run in its own process, the table, the baselines and libraries, and the
bench's other measurements (copy bandwidth, the region's layout, the remote's upload, the smallest
interval within a budget, the trainers)."""
