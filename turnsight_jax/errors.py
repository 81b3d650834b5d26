"""The project's error types (a leaf module: anything may import it)."""


class ConfigError(ValueError):
    """An invalid configuration, reported as one line before anything compiles."""


class NonFiniteTraining(RuntimeError):
    """`train.max_skipped_steps` steps in a row had a non-finite loss or gradient; the run stopped
    with its parameters and last checkpoint as they were before the first of them."""


class CheckpointError(ValueError):
    """No usable checkpoint where one is required: every step under `checkpoints/` is invalid
    (incomplete or corrupt, see `checkpointing.check_step`), or the step asked for is."""


class WorkdirInUse(RuntimeError):
    """Another trainer holds the run folder's lock (`checkpointing.WorkdirLock`): the message is one
    line naming it (pid, host, since when). The trainer exits 2."""
