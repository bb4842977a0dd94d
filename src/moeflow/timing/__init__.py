"""How moeflow times work: medians of round-robin runs and the slowest rank (:mod:`.measure`), and
the forward and backward time of each named phase of a training step (:mod:`.phases`)."""
