"""Operating-system primitives (prctl, pidfd, exit status): the lowest layer."""
