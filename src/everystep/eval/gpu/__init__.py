"""``everystep gpu-check``: what it runs and how much, its rounds of the bench, the check itself and
its report."""
