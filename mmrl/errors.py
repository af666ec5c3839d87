"""Errors that end a run with a message for the user rather than a traceback (the CLI prints them)."""


class RolloutError(RuntimeError):
    """The rollout engine failed; the message names the step and where the last checkpoint is."""
