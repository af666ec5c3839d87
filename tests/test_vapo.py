"""VAPO's parts on top of GAE (Yue et al. 2025, arXiv 2504.05118): decoupled and length-adaptive GAE and
the positive-example LM loss against values worked out by hand, their config keys, and a run of the
recipe through the CLI with value pretraining."""

from __future__ import annotations

import statistics
from pathlib import Path

import pytest
import torch
from algorithm_cases import PAD, close
from helpers import FAST

from mmrl.algorithms import gae, needs_of, positive_example_nll
from mmrl.cli import main
from mmrl.config import load_config
from mmrl.data.synthetic import generate
from mmrl.errors import ConfigError
from mmrl.run.logger import read_metrics
from mmrl.training.critic import needs_critic

CONFIGS = Path(__file__).resolve().parent.parent / "configs"
VAPO = CONFIGS / "quickstart_vapo.yaml"

# Row 0: three tokens, reward 1 on the last; row 1: two tokens, reward −1, then padding whose junk
# rewards and values must not leak in. γ = 0.9 throughout.
REWARDS = torch.tensor([[0.0, 0.0, 1.0], [0.0, -1.0, PAD]])
VALUES = torch.tensor([[0.5, 0.6, 0.8], [0.2, -0.4, PAD]])
MASK = torch.tensor([[1, 1, 1], [1, 1, 0]])
# δ_t = r_t + 0.9·V_{t+1} − V_t: row 0 δ = 0.04, 0.12, 0.2 ; row 1 δ = −0.56, −0.6
# λ = 1 makes R_t the discounted return-to-go: row 0 0.81, 0.9, 1 ; row 1 −0.9, −1
MONTE_CARLO = [[0.81, 0.9, 1.0], [-0.9, -1.0, 0.0]]


def whitened(raw: list[float]) -> list[list[float]]:
    """The five valid tokens' raw advantages whitened over the batch, laid out as MASK (0 on padding)."""
    mean, std = statistics.mean(raw), statistics.stdev(raw)
    w = [(a - mean) / (std + 1e-6) for a in raw]
    return [w[:3], [*w[3:], 0.0]]


def test_decoupled_gae_gives_the_critic_its_own_lambda_by_hand() -> None:
    # policy λ = 0.5 (γλ = 0.45): row 0 Â = 0.04 + 0.45·0.21 = 0.1345, 0.12 + 0.45·0.2 = 0.21, 0.2
    #                             row 1 Â = −0.56 + 0.45·(−0.6) = −0.83, −0.6
    # critic λ = 1: the returns are the Monte-Carlo returns, whatever V says
    advantages, returns = gae(
        REWARDS, MASK, torch.arange(2), values=VALUES, gamma=0.9, lam=0.5, critic_lam=1.0
    )
    close(advantages, whitened([0.1345, 0.21, 0.2, -0.83, -0.6]))
    close(returns, MONTE_CARLO)
    # without critic_lam both use λ = 0.5: R = Â + V = 0.6345, 0.81, 1 | −0.63, −1
    _, coupled = gae(REWARDS, MASK, torch.arange(2), values=VALUES, gamma=0.9, lam=0.5)
    close(coupled, [[0.6345, 0.81, 1.0], [-0.63, -1.0, 0.0]])


def test_length_adaptive_lambda_per_response_by_hand() -> None:
    # α = 1: λ = 1 − 1/(1·3) = 2/3 for row 0 (γλ = 0.6), 1 − 1/2 = 0.5 for row 1 (γλ = 0.45)
    #   row 0: Â2 = 0.2 ; Â1 = 0.12 + 0.6·0.2 = 0.24 ; Â0 = 0.04 + 0.6·0.24 = 0.184
    #   row 1: Â1 = −0.6 ; Â0 = −0.56 + 0.45·(−0.6) = −0.83
    # it replaces lam for the policy only: the critic keeps lam = 0, the TD target r_t + 0.9·V_{t+1}
    #   row 0: 0.54, 0.72, 1 ; row 1: −0.36, −1
    options = {"values": VALUES, "gamma": 0.9, "length_adaptive_alpha": 1.0}
    advantages, returns = gae(REWARDS, MASK, torch.arange(2), lam=0.0, **options)
    close(advantages, whitened([0.184, 0.24, 0.2, -0.83, -0.6]))
    close(returns, [[0.54, 0.72, 1.0], [-0.36, -1.0, 0.0]])
    # with VAPO's critic_lam = 1 the critic's returns are the Monte-Carlo ones again
    _, returns = gae(REWARDS, MASK, torch.arange(2), lam=0.0, critic_lam=1.0, **options)
    close(returns, MONTE_CARLO)


def test_length_adaptive_lambda_is_clipped_to_zero_for_short_responses() -> None:
    # the paper's α = 0.05 on 3 and 2 tokens: 1 − 1/0.15 < 0 → λ = 0, Â = δ = 0.04, 0.12, 0.2 | −0.56, −0.6
    advantages, _ = gae(
        REWARDS, MASK, torch.arange(2), values=VALUES, gamma=0.9, lam=1.0, length_adaptive_alpha=0.05
    )
    close(advantages, whitened([0.04, 0.12, 0.2, -0.56, -0.6]))


def test_length_adaptive_lambda_with_the_papers_alpha_on_long_responses() -> None:
    # α = 0.05, γ = 1, V = 0, reward 1 on the last token: δ_t = 0 except the last, so Â_t = λ^(l−1−t)
    #   l = 40: λ = 1 − 1/(0.05·40) = 0.5 → Â_t = 0.5^(39−t) ; l = 20 (padded): λ = 1 − 1/1 = 0 → 1 on its last token
    rewards, mask = torch.zeros(2, 40), torch.zeros(2, 40)
    mask[0], mask[1, :20] = 1, 1
    rewards[0, 39], rewards[1, 19], rewards[1, 30] = 1.0, 1.0, PAD
    values = torch.where(mask.bool(), 0.0, PAD)
    advantages, returns = gae(rewards, mask, torch.arange(2), values=values, length_adaptive_alpha=0.05)
    raw = [0.5 ** (39 - t) for t in range(40)] + [0.0] * 19 + [1.0]
    mean, std = statistics.mean(raw), statistics.stdev(raw)
    w = [(a - mean) / (std + 1e-6) for a in raw]
    close(advantages, [w[:40], w[40:] + [0.0] * 20])
    close(returns, [[1.0] * 40, [1.0] * 20 + [0.0] * 20])  # lam = 1 for the critic: the return, 1


def test_positive_example_nll_by_hand() -> None:
    # scores 1, 0, 0.5: rows 0 and 2 are positive. Their valid tokens: −1, −2 and −3 → L = 6/3 = 2
    logp = torch.tensor([[-1.0, -2.0, PAD], [-0.5, -0.5, -0.5], [-3.0, PAD, PAD]], requires_grad=True)
    mask = torch.tensor([[1, 1, 0], [1, 1, 1], [1, 0, 0]])
    scores = torch.tensor([1.0, 0.0, 0.5])
    loss = positive_example_nll(logp, mask, scores)
    close(loss, 2.0)
    loss.backward()  # −1/3 on each positive valid token, nothing on the row scored 0 or on padding
    t = 1 / 3
    close(logp.grad, [[-t, -t, 0.0], [0.0, 0.0, 0.0], [-t, 0.0, 0.0]])
    # a mini-batch's count of positive tokens divides instead (6 here, the other 3 in other micro-batches);
    # the mini-batch's other totals are ignored
    totals = {"num_tokens": 10.0, "num_seqs": 5.0, "horizon": 3, "num_positive_tokens": 6.0}
    close(positive_example_nll(logp, mask, scores, **totals), 1.0)
    # no positive response: 0, not NaN
    close(positive_example_nll(logp, mask, torch.tensor([0.0, -1.0, 0.0])), 0.0)


def test_gae_declares_its_critic_and_the_vapo_recipe_selects_every_part() -> None:
    assert needs_of(gae).critic
    cfg = load_config(VAPO)
    assert needs_critic(cfg) and cfg.critic.pretrain_steps > 0
    assert (cfg.algorithm.critic_lam, cfg.algorithm.length_adaptive_alpha) == (1.0, 0.5)
    assert cfg.actor.positive_lm_coef == 0.1 and cfg.actor.loss_agg_mode == "token-mean"
    assert cfg.actor.clip_ratio_high > cfg.actor.clip_ratio_low
    assert not needs_critic(load_config(CONFIGS / "quickstart.yaml"))


@pytest.mark.parametrize("key", ["algorithm.critic_lam=1.0", "algorithm.length_adaptive_alpha=0.05"])
def test_gae_lambda_options_need_a_critic(key: str) -> None:
    name = key.split("=")[0].replace(".", r"\.")
    with pytest.raises(ConfigError, match=rf"{name}.*adv_estimator=grpo has none.*adv_estimator=gae"):
        load_config(CONFIGS / "quickstart.yaml", [key])


def test_value_pretraining_must_leave_steps_for_the_actor() -> None:
    with pytest.raises(ConfigError, match=r"critic\.pretrain_steps \(5\).*trainer\.total_steps \(5\)"):
        load_config(VAPO, ["trainer.total_steps=5"])


# Half the responses, by their text, score 1 and the others −1: positive examples for the LM loss and a
# reward that differs between responses, so the critic has targets (a random tiny model is never right).
SIGNED = "def signed(sample):\n    return 1.0 if sum(map(ord, sample.response)) % 2 else -1.0\n"


def test_vapo_recipe_pretrains_the_value_then_trains_both(tmp_path: Path, tiny_model_dir: Path) -> None:
    generate(tmp_path / "data", task="color", n_train=8, n_val=0, seed=0, image_size=56)
    reward = tmp_path / "signed.py"
    reward.write_text(SIGNED)
    code = main(
        [
            "train",
            str(VAPO),
            f"model.path={tiny_model_dir}",
            f"data.train_files={tmp_path / 'data' / 'train.jsonl'}",
            "data.val_files=[]",
            f"trainer.output_dir={tmp_path / 'run'}",
            *FAST,
            "data.min_pixels=3136",
            "data.max_pixels=3136",
            "critic.pretrain_steps=1",
            f"reward.functions=[{{name: '{reward}:signed'}}]",
        ]
    )
    assert code == 0
    first, second = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert "critic/vf_loss" in first and "actor/pg_loss" not in first  # value pretraining: the actor waits
    assert "critic/vf_loss" in second and "actor/pg_loss" in second
    assert second["actor/positive_lm_loss"] > 0  # the NLL of the responses that scored 1
