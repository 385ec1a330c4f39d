"""A step's samples and how they are cut: the batch type (`RolloutBatch` of `Sample`s), Karmarkar–Karp balancing,
packing (plain and prefix-grouped), mini- and micro-batches, and each rank's share."""
