"""Errors that end a run with a message for the user rather than a traceback (the CLI prints them)."""


class RunStopped(RuntimeError):
    """The run stopped for a reason the message explains, naming the step, what is intact and what to do."""


class RolloutError(RunStopped):
    """The rollout engine failed; the message names the step and where the last checkpoint is."""


class CheckpointError(RunStopped):
    """A checkpoint could not be written (a full disk, say); earlier checkpoints are untouched."""


class NumericalError(RunStopped):
    """Too many steps in a row had non-finite gradients; the last good state was saved first."""


class WorkerError(RunStopped):
    """A Ray worker died or raised; the message names the worker, where it ran, and the step."""


class ResourceError(RunStopped):
    """The Ray cluster cannot hold the workers asked for; raised at startup instead of waiting forever."""


class RewardError(RunStopped):
    """A reward function failed on every sample for too many steps in a row; the run would learn nothing."""


class ConfigError(ValueError):
    """A configuration problem, with a message meant for the person running the command."""
