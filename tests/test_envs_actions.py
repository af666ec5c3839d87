"""Action tokenizer: bins round-trip within half a bin, q01/q99 statistics, chunks, malformed output."""

from __future__ import annotations

import json

import numpy as np
import pytest

from mmrl.envs.actions import ActionStats, ActionTokenizer, InvalidAction


@pytest.mark.parametrize("n_bins", [256, 7])
def test_round_trip_within_half_a_bin(n_bins: int) -> None:
    tok = ActionTokenizer(action_dim=3, start_id=1000, n_bins=n_bins)
    rng = np.random.default_rng(0)
    actions = np.concatenate([rng.uniform(-1, 1, (500, 3)), [[-1.0, 0.0, 1.0]]])
    half_bin = 1.0 / n_bins  # bins are 2 / n_bins wide
    for a in actions:
        ids = tok.encode(a)
        assert len(ids) == 3 and all(i in tok.token_ids for i in ids)
        decoded = tok.decode(ids)
        assert isinstance(decoded, np.ndarray) and decoded.shape == (1, 3)
        assert np.abs(decoded[0] - a).max() <= half_bin + 1e-12


def test_out_of_range_actions_are_clipped_to_the_edge_bins() -> None:
    tok = ActionTokenizer(action_dim=2, start_id=0)
    assert tok.encode(np.array([-5.0, 5.0])) == [0, 255]


def test_openvla_convention_uses_the_last_ids_of_the_vocabulary() -> None:
    tok = ActionTokenizer.for_vocab(151936, action_dim=7)
    assert tok.start_id == 151936 - 256
    assert tok.token_ids == range(151680, 151936)
    assert tok.encode(np.ones(7)) == [151935] * 7
    with pytest.raises(ValueError, match="cannot hold"):
        ActionTokenizer.for_vocab(100, action_dim=7)


def test_chunks_are_step_major() -> None:
    tok = ActionTokenizer(action_dim=2, start_id=10, n_bins=4, chunk=3)
    actions = np.array([[-1.0, 1.0], [-0.4, 0.4], [0.1, -0.9]])
    ids = tok.encode(actions)
    assert tok.n_tokens == 6
    assert ids == [10, 13, 11, 12, 12, 10]
    decoded = tok.decode(ids)
    assert isinstance(decoded, np.ndarray) and decoded.shape == (3, 2)
    np.testing.assert_allclose(decoded, [[-0.75, 0.75], [-0.25, 0.25], [0.25, -0.75]])
    with pytest.raises(ValueError, match=r"shape \(3, 2\)"):
        tok.encode(np.zeros(2))  # a single step is not a chunk of 3


@pytest.mark.parametrize(
    ("ids", "kind", "words"),
    [
        ([], "length", "expected 4 action tokens (2 step(s) x 2 dims), got 0"),
        ([100, 101, 102], "length", "got 3"),
        ([100, 101, 102, 103, 104], "length", "got 5"),
        ([100, 99, 102, 103], "out_of_range", "id 99 at position 1"),
        ([100, 101, 102, 100 + 256], "out_of_range", "id 356 at position 3); action ids are 100..355"),
        ([-1, 5, 102, 103], "out_of_range", "2 of 4 tokens"),
    ],
)
def test_malformed_sequences_give_invalid_action_with_a_reason(ids: list[int], kind: str, words: str) -> None:
    tok = ActionTokenizer(action_dim=2, start_id=100, chunk=2)
    result = tok.decode(ids)
    assert isinstance(result, InvalidAction)
    assert result.kind == kind
    assert words in result.reason


def test_stats_by_hand() -> None:
    actions = np.stack([np.arange(101.0), np.full(101, 3.0)], axis=1)  # 0..100 and a constant
    stats = ActionStats.from_demos(actions)
    np.testing.assert_allclose(stats.q01, [1.0, 3.0])
    np.testing.assert_allclose(stats.q99, [99.0, 3.0])
    np.testing.assert_allclose(stats.normalize(np.array([50.0, 3.0])), [0.0, 0.0])
    np.testing.assert_allclose(stats.normalize(np.array([1.0, 7.0])), [-1.0, 0.0])
    np.testing.assert_allclose(stats.normalize(np.array([-20.0, 3.0])), [-1.0, 0.0])  # clipped
    np.testing.assert_allclose(stats.normalize(np.array([500.0, 3.0])), [1.0, 0.0])
    np.testing.assert_allclose(stats.unnormalize(np.array([0.0, 0.5])), [50.0, 3.0])


def test_stats_over_episodes_equal_stats_over_their_steps() -> None:
    rng = np.random.default_rng(1)
    episodes = [rng.normal(size=(n, 2)) for n in (5, 17, 9)]
    by_episode = ActionStats.from_demos(episodes)
    flat = ActionStats.from_demos(np.concatenate(episodes))
    np.testing.assert_array_equal(by_episode.q01, flat.q01)
    np.testing.assert_array_equal(by_episode.q99, flat.q99)
    restored = ActionStats.from_dict(json.loads(json.dumps(by_episode.to_dict())))
    np.testing.assert_array_equal(restored.q99, by_episode.q99)


@pytest.mark.parametrize(
    "bad", [[], np.zeros((0, 2)), [np.zeros((3, 2)), np.zeros((3, 4))], np.array([[np.nan]])]
)
def test_stats_reject_empty_ragged_or_non_finite_demos(bad: object) -> None:
    with pytest.raises(ValueError, match="demo actions"):
        ActionStats.from_demos(bad)


def test_round_trip_with_stats_is_within_half_a_bin_in_demo_units() -> None:
    rng = np.random.default_rng(2)
    demos = rng.uniform([-0.05, 2.0], [0.05, 6.0], size=(1000, 2))
    stats = ActionStats.from_demos(demos)
    tok = ActionTokenizer(action_dim=2, start_id=0, stats=stats)
    half_bin = (stats.q99 - stats.q01) / 256
    inside = demos[np.all((demos >= stats.q01) & (demos <= stats.q99), axis=1)]
    for a in inside[:200]:
        decoded = tok.decode(tok.encode(a))
        assert isinstance(decoded, np.ndarray)
        assert np.all(np.abs(decoded[0] - a) <= half_bin + 1e-12)


def test_invalid_construction_and_inputs_fail_with_a_message() -> None:
    with pytest.raises(ValueError, match="n_bins"):
        ActionTokenizer(action_dim=2, start_id=0, n_bins=0)
    with pytest.raises(ValueError, match="start_id"):
        ActionTokenizer(action_dim=2, start_id=-1)
    with pytest.raises(ValueError, match="action_dim=3"):
        ActionTokenizer(action_dim=3, start_id=0, stats=ActionStats.from_demos(np.zeros((4, 2))))
    tok = ActionTokenizer(action_dim=2, start_id=0)
    with pytest.raises(ValueError, match="finite"):
        tok.encode(np.array([np.nan, 0.0]))
