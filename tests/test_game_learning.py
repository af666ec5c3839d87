"""RL teaches the tiny policy the built-in game (`configs/quickstart_game.yaml` at the size
`learning_runs.RUNS["game"]` gives): gridnav played turn by turn, a frame each turn, GiGPO crediting
each move. Greedy success on 100 seeds that training never meets rises from the random-move warm-up's."""

from __future__ import annotations

import pytest
from learning_runs import RUNS, train_until_learned


@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_gigpo_teaches_the_game_quickstart(tmp_path, tiny_model_dir) -> None:
    run = RUNS["game"]
    trained = train_until_learned("game", tmp_path, tiny_model_dir)
    records, first, last = trained.records, trained.first, trained.last
    assert first < 0.2, f"the warm-up alone should not play the game: greedy success {first}"
    assert last - first >= run.min_gain, f"greedy success on held-out seeds went {first:.2f} -> {last:.2f}"
    assert all(r["game/invalid"] < 1 for r in records if "game/invalid" in r), "moves should stay moves"
