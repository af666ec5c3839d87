"""When a run has learned enough: `trainer.stop_at` (absolute targets) and `trainer.stop_at_gain` (rises
over the validation before training), checked at each periodic validation."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rich.console import Console

from mmrl.config.trainer import TrainerConfig
from mmrl.errors import ConfigError
from mmrl.run.logger import read_metrics


class StopTargets:
    """The run's targets; `baseline` is the step-0 validation (a resumed run reads it from its log)."""

    def __init__(self, cfg: TrainerConfig, metrics_log: Path, console: Console) -> None:
        self.cfg, self.metrics_log, self.console = cfg, metrics_log, console
        self.baseline: dict[str, Any] | None = None

    def reached(self, step: int, validation: dict[str, Any]) -> bool:
        """Whether this validation meets every target (never without targets, and never at step 0, so a
        run always trains). A target the validation does not report fails at once, before any training."""
        missing = sorted((set(self.cfg.stop_at) | set(self.cfg.stop_at_gain)) - set(validation))
        if missing:
            found = sorted(k for k in validation if k.startswith("val/"))
            raise ConfigError(
                f"trainer.stop_at names {missing}, which this run's validation does not report; it reports "
                f"{', '.join(found) or 'nothing'}"
            )
        if step == 0:
            return False
        targets = dict(self.cfg.stop_at)
        for name, gain in self.cfg.stop_at_gain.items():
            targets[name] = max(targets.get(name, -float("inf")), self._baseline()[name] + gain)
        if not targets or not all(validation[name] >= value for name, value in targets.items()):
            return False
        met = ", ".join(f"{name} {validation[name]:.3g} >= {value:.3g}" for name, value in targets.items())
        self.console.print(f"step {step}: {met} (trainer.stop_at): the run ends here", markup=False)
        return True

    def _baseline(self) -> dict[str, Any]:
        if self.baseline is None:
            first = read_metrics(self.metrics_log)[:1]
            if not first or first[0]["step"] != 0:
                raise ConfigError(
                    f"trainer.stop_at_gain counts from the validation before training, which "
                    f"{self.metrics_log} does not hold: drop trainer.stop_at_gain or use trainer.stop_at"
                )
            self.baseline = first[0]
        return self.baseline
