"""``everystep simulate``: the wasted time of a long job under exponential failures (Monte Carlo and
analytic), and the command around it."""
