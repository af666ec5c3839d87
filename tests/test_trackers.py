"""wandb and swanlab as metric backends.

Neither package is installed here and no tracking server is reachable, so each test puts a stand-in
module under the package's name that records the calls mmrl makes; what is checked is mmrl's side:
scalars only, the step, one run continued across a resume, and a clear error when the package is missing."""

from __future__ import annotations

import sys
from types import SimpleNamespace

import pytest

from mmrl.errors import ConfigError
from mmrl.run.logger import MetricsLogger


class StandIn:
    """Records init/log/finish as the tracker packages expose them at module level."""

    def __init__(self) -> None:
        self.inits: list[dict] = []
        self.logged: list[tuple[dict, int]] = []
        self.finished = 0

    def init(self, **kwargs) -> SimpleNamespace:
        self.inits.append(kwargs)
        return SimpleNamespace(id=kwargs.get("id") or "run-42")

    def log(self, values: dict, step: int) -> None:
        self.logged.append((values, step))

    def finish(self) -> None:
        self.finished += 1


@pytest.mark.parametrize("kind", ["wandb", "swanlab"])
def test_tracker_gets_scalars_per_step_and_resumes_the_same_run(kind, tmp_path, monkeypatch) -> None:
    stand_in = StandIn()
    monkeypatch.setitem(sys.modules, kind, stand_in)
    logger = MetricsLogger(tmp_path, ["jsonl", kind], name="geo", config={"actor": {"lr": 1e-6}})
    logger.log(3, {"reward/mean": 0.5, "data/rows": [1, 2], "val/accuracy": 1})
    logger.close()
    assert stand_in.logged == [({"reward/mean": 0.5, "val/accuracy": 1}, 3)]  # lists stay in metrics.jsonl
    assert stand_in.inits[0]["config"] == {"actor": {"lr": 1e-6}} and stand_in.inits[0]["id"] is None
    assert stand_in.finished == 1
    MetricsLogger(tmp_path, [kind])  # a resumed run reopens the run it started
    assert stand_in.inits[1]["id"] == "run-42" and stand_in.inits[1]["resume"] == "allow"


def test_a_missing_tracker_package_is_a_config_error_that_says_what_to_do(tmp_path, monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "wandb", None)  # makes `import wandb` fail like an absent package
    with pytest.raises(ConfigError, match=r"pip install wandb.*or remove wandb from trainer\.loggers"):
        MetricsLogger(tmp_path, ["wandb"])
