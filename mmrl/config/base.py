"""The base of every config section: strict about keys, and checked again on assignment."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class Section(BaseModel):
    """Unknown keys are refused so a typo fails at start; assignments are validated like the YAML; no
    number key takes inf or NaN (a penalty of inf makes every return -inf, a NaN poisons the loss)."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)
