"""`RewardSetupError`: a mistake that would make every sample of a data source fail, so it stops the run."""


class RewardSetupError(RuntimeError):
    """Unknown data_source, missing optional dependency: raised to the trainer instead of scoring 0 forever.

    Everything else a scoring function does wrong (an exception on one sample, a hang, a NaN) scores that sample 0
    and the run continues.
    """
