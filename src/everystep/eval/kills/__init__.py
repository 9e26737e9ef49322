"""The kill harness: the training driver behind ``everystep train`` (one loop, failures injected,
crash-restart under a supervisor), its run configuration and summary, hosts lost and replaced on one
machine, ``everystep recover``, and the same kill-and-resume over the checkpointing libraries."""
