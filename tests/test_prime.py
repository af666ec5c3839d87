"""PRIME (Cui et al. 2025, "Process Reinforcement through Implicit Rewards", arXiv 2502.01456): the implicit
process reward, the PRM's cross-entropy loss and the advantage that combines both rewards' RLOO, against
values worked out by hand from the paper's formulas (padding, uneven groups, a group of one, an all-equal
group); its config keys and refusals; and a run of the recipe through the CLI whose PRM a resume restores
exactly. The 2-worker FSDP2 parity of the PRM's update is in tests/test_distributed.py."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from algorithm_cases import GROUPS, MASK, PAD, REWARDS, close
from helpers import FAST, tiny_vla_config

from mmrl.algorithms import (
    batch_normalized_process_rewards,
    implicit_prm_loss,
    implicit_process_rewards,
    needs_of,
    prime,
)
from mmrl.cli import main
from mmrl.config import load_config
from mmrl.data.batch import Batch
from mmrl.data.synthetic import generate
from mmrl.errors import ConfigError
from mmrl.models import load_policy
from mmrl.run import checkpoint as ckpt
from mmrl.run.logger import read_metrics
from mmrl.trainer import Trainer
from mmrl.training.actor import needs_reference
from mmrl.training.critic import needs_critic
from mmrl.training.prm import needs_prm, train_and_score

CONFIGS = Path(__file__).resolve().parent.parent / "configs"
PRIME = CONFIGS / "quickstart_prime.yaml"

# Two responses, T = 3: row 0 has two tokens and junk on its padding, row 1 three.
PRM_LOGP = torch.tensor([[-1.0, -2.0, PAD], [-0.5, -1.5, -3.0]])
REF_LOGP = torch.tensor([[-1.5, -1.0, -PAD], [-0.5, -2.0, -4.0]])
TWO_ROWS = torch.tensor([[1, 1, 0], [1, 1, 1]])


def softplus(x: float) -> float:
    return math.log1p(math.exp(x))


def sigmoid(x: float) -> float:
    return 1 / (1 + math.exp(-x))


def test_implicit_process_reward_is_beta_times_the_token_log_ratio_by_hand() -> None:
    # Eq. 3, β = 0.5: row 0 log-ratios 0.5, −1 → 0.25, −0.5 (padding 0, not 0.5·198);
    # row 1 log-ratios 0, 0.5, 1 → 0, 0.25, 0.5
    rewards = implicit_process_rewards(PRM_LOGP, REF_LOGP, TWO_ROWS, beta=0.5)
    close(rewards, [[0.25, -0.5, 0.0], [0.0, 0.25, 0.5]])


def test_batch_normalization_scales_the_largest_process_return_to_one_by_hand() -> None:
    # Rewards [[0.25, −0.5, junk], [0, 0.25, 0.5]] (junk on padding): returns-to-go row 0 −0.25, −0.5, 0;
    # row 1 0.75, 0.75, 0.5. The largest |return| is 0.75, so every reward is divided by 0.75 (+1e-6).
    rewards = torch.tensor([[0.25, -0.5, 7.0], [0.0, 0.25, 0.5]])
    scaled = batch_normalized_process_rewards(rewards, TWO_ROWS)
    close(scaled, [[1 / 3, -2 / 3, 0.0], [0.0, 1 / 3, 2 / 3]], atol=1e-5)
    # All zero (a PRM still equal to the reference): stays zero, no division by zero.
    assert torch.equal(batch_normalized_process_rewards(torch.zeros(2, 3), TWO_ROWS), torch.zeros(2, 3))


def test_prm_cross_entropy_on_outcome_labels_by_hand() -> None:
    # L_CE (Algorithm 1 line 8), β = 0.5: r_φ(y) = β·Σ_t log-ratio: row 0 0.5·(0.5 − 1) = −0.25, row 1 0.5·(0 + 0.5 + 1) = 0.75.
    # Row 2 has no response tokens (a worker's padding row): no loss, whatever its junk and label.
    prm_logp = torch.cat([PRM_LOGP, torch.full((1, 3), PAD)]).requires_grad_(True)
    ref_logp = torch.cat([REF_LOGP, torch.full((1, 3), -PAD)])
    mask = torch.cat([TWO_ROWS, torch.zeros(1, 3, dtype=torch.long)])
    # labels 0, 1: −log(1 − σ(−0.25)) = softplus(−0.25) and −log σ(0.75) = softplus(−0.75), mean over 2 rows
    labels = torch.tensor([0.0, 1.0, 1.0])
    loss, metrics = implicit_prm_loss(prm_logp, ref_logp, mask, labels, beta=0.5)
    close(loss, (softplus(-0.25) + softplus(-0.75)) / 2)
    close(metrics["accuracy"], 1.0)  # σ(−0.25) < ½ for label 0, σ(0.75) > ½ for label 1
    # ∂L/∂log π_φ(y_t) = β·(σ(r_φ(y)) − y)/N on every valid token of the row, 0 on padding and on row 2
    loss.backward()
    g0, g1 = 0.5 * sigmoid(-0.25) / 2, 0.5 * (sigmoid(0.75) - 1) / 2
    close(prm_logp.grad, [[g0, g0, 0.0], [g1, g1, g1], [0.0, 0.0, 0.0]])
    # row 0 labelled 1 instead: softplus(0.25), and it is now on the wrong side of ½
    loss, metrics = implicit_prm_loss(prm_logp, ref_logp, mask, torch.tensor([1.0, 1.0, 0.0]), beta=0.5)
    close(loss, (softplus(0.25) + softplus(-0.75)) / 2)
    close(metrics["accuracy"], 0.5)
    # under gradient accumulation the mini-batch's row count divides instead (4: two rows elsewhere)
    loss, _ = implicit_prm_loss(prm_logp, ref_logp, mask, labels, beta=0.5, num_seqs=4.0, horizon=3)
    close(loss, (softplus(-0.25) + softplus(-0.75)) / 4)
    # a soft label ½ (a reward between 0 and 1): −½·log σ(s) − ½·log(1 − σ(s)) = ½·(softplus(−s) + softplus(s))
    loss, _ = implicit_prm_loss(prm_logp[:1], ref_logp[:1], mask[:1], torch.tensor([0.5]), beta=0.5)
    close(loss, 0.5 * (softplus(0.25) + softplus(-0.25)))


# The implicit process rewards of algorithm_cases' seven rows (junk on padding). Per-token means:
# row 0: 0/3 = 0, row 1: 0.3 (a group of one), row 2: 0.6/1, row 3: 0.4/2 = 0.2, row 4: −0.2/2 = −0.1,
# row 5: 0.6/3 = 0.2, row 6: 0.3/3 = 0.1
PROCESS = torch.tensor(
    [
        [0.3, 0.0, -0.3],
        [0.2, 0.4, PAD],
        [0.6, PAD, PAD],
        [0.1, 0.3, PAD],
        [-0.2, 0.0, PAD],
        [0.2, 0.2, 0.2],
        [0.0, 0.3, 0.0],
    ]
)


def test_prime_advantage_combines_both_leave_one_out_baselines_by_hand() -> None:
    # Eq. 5 with γ = 1. Process part, group 7 (rows 0, 2, 4, 6; means 0, 0.6, −0.1, 0.1, Σ = 0.6, K = 4):
    #   b_0 = (0.6 − 0)/3 = 0.2        row 0: 0.1, −0.2, −0.5   → to go −0.6, −0.7, −0.5
    #   b_2 = (0.6 − 0.6)/3 = 0        row 2: 0.6               → 0.6
    #   b_4 = (0.6 + 0.1)/3 = 0.2333…  row 4: −0.4333…, −0.2333… → −0.6667, −0.2333
    #   b_6 = (0.6 − 0.1)/3 = 0.1667   row 6: −0.1667, 0.1333, −0.1667 → −0.2, −0.0333, −0.1667
    # group 1 (rows 3, 5; equal outcomes 2, 2 but means 0.2, 0.2): b = 0.2 for both
    #   row 3: −0.1, 0.1 → 0, 0.1 ;  row 5: 0, 0, 0 → 0, 0, 0
    # a group of one (row 1): no baseline, 0.
    # Outcome part (RLOO, Eq. 4), group 7 scores 1, 0, 0, 1: ±(1 − 1/3) = ±2/3 on every token; groups 1 and 3: 0.
    adv, returns = prime(REWARDS, MASK, GROUPS, process_rewards=PROCESS)
    o = 2 / 3
    close(
        adv,
        [
            [o - 0.6, o - 0.7, o - 0.5],
            [0.0, 0.0, 0.0],
            [-o + 0.6, 0.0, 0.0],
            [0.0, 0.1, 0.0],
            [-o - 2 / 3, -o - 0.7 / 3, 0.0],
            [0.0, 0.0, 0.0],
            [o - 0.2, o - 0.1 / 3, o - 0.5 / 3],
        ],
    )
    # returns: the score plus the raw process rewards to go (no baseline)
    close(
        returns,
        [
            [1.0, 0.7, 0.7],
            [5.6, 5.4, 0.0],
            [0.6, 0.0, 0.0],
            [2.4, 2.3, 0.0],
            [-0.2, 0.0, 0.0],
            [2.6, 2.4, 2.2],
            [1.3, 1.3, 1.0],
        ],
    )


def test_prime_discount_and_weights_by_hand() -> None:
    # row 0, γ = 0.5: centred 0.1, −0.2, −0.5 → to go: −0.5 ; −0.2 + 0.5·(−0.5) = −0.45 ; 0.1 + 0.5·(−0.45) = −0.125
    # c_o = 3, c_p = 2: 3·(2/3) + 2·(−0.125, −0.45, −0.5) = 1.75, 1.1, 1.0
    adv, _ = prime(
        REWARDS, MASK, GROUPS, process_rewards=PROCESS, gamma=0.5, outcome_coef=3.0, process_coef=2.0
    )
    close(adv[0], [1.75, 1.1, 1.0])
    # the process part alone (c_o = 0) of a group whose outcomes are all equal still ranks its tokens
    adv, _ = prime(REWARDS, MASK, GROUPS, process_rewards=PROCESS, outcome_coef=0.0)
    close(adv[3], [0.0, 0.1, 0.0])
    with pytest.raises(ValueError, match="process_rewards"):
        prime(REWARDS, MASK, GROUPS)


def test_prime_declares_its_prm_and_the_recipe_selects_it() -> None:
    assert needs_of(prime).prm and needs_of(prime).groups and not needs_of(prime).critic
    cfg = load_config(PRIME)
    assert needs_prm(cfg) and needs_reference(cfg) and not needs_critic(cfg)
    assert cfg.prm.beta == 0.05 and cfg.algorithm.estimator_options()["process_coef"] == 0.2
    # the reference the PRM's rewards are measured against is loaded even without a KL term
    assert needs_reference(load_config(PRIME, ["actor.use_kl_loss=false"]))
    assert not needs_prm(load_config(CONFIGS / "quickstart.yaml"))


def test_prime_refusals_name_the_fix() -> None:
    with pytest.raises(
        ConfigError, match=r"prime_outcome_coef=0 and .*prime_process_coef=0.*set one of them"
    ):
        load_config(PRIME, ["algorithm.prime_outcome_coef=0", "algorithm.prime_process_coef=0"])
    with pytest.raises(ConfigError, match=r"adv_estimator=prime compares responses.*rollout\.n >= 2"):
        load_config(PRIME, ["rollout.n=1", "rollout.temperature=1.0", "algorithm.dynamic_sampling=false"])
    with pytest.raises(ConfigError, match=r"prime rewards the tokens of single-turn.*env section.*use grpo"):
        tiny_vla_config(Path("model"), Path("run"), "algorithm.adv_estimator=prime")
    agent = CONFIGS / "quickstart_agent.yaml"
    with pytest.raises(
        ConfigError, match=r"prime rewards the tokens of single-turn.*agent section.*use grpo"
    ):
        load_config(agent, ["algorithm.adv_estimator=prime"])


def test_prime_refuses_rewards_outside_zero_one_before_training_the_prm() -> None:
    cfg = load_config(PRIME)
    batch = Batch(tensors={"scores": torch.tensor([1.0, -1.0])})
    with pytest.raises(ConfigError, match=r"labels in \[0, 1\].*\[-1, 1\].*answer_match"):
        train_and_score(None, cfg, batch)


# Half the responses, by their text, score 1 and the others 0: outcome labels on both sides for the PRM (a
# random tiny model is never right).
PARITY = "def parity(sample):\n    return float(sum(map(ord, sample.response)) % 2)\n"


def parity_run(tmp_path: Path, model: Path, run: str, *extra: str) -> list[str]:
    """The overrides of a short PRIME recipe run in `tmp_path / run`, rewarded by `PARITY`."""
    data = tmp_path / "data"
    if not data.exists():
        generate(data, task="color", n_train=8, n_val=0, seed=0, image_size=56)
        (tmp_path / "parity.py").write_text(PARITY)
    return [
        f"model.path={model}",
        f"data.train_files={data / 'train.jsonl'}",
        "data.val_files=[]",
        f"trainer.output_dir={tmp_path / run}",
        *FAST,
        "data.min_pixels=3136",
        "data.max_pixels=3136",
        f"reward.functions=[{{name: '{tmp_path / 'parity.py'}:parity'}}]",
        *extra,
    ]


@pytest.mark.slow
def test_prime_recipe_trains_its_prm_and_a_resume_restores_it_exactly(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    overrides = parity_run(tmp_path, tiny_model_dir, "run")
    assert main(["train", str(PRIME), *overrides]) == 0
    records = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert [r["step"] for r in records] == [1, 2]
    for record in records:
        assert {"prm/loss", "prm/accuracy", "prm/grad_norm", "actor/pg_loss"} <= set(record)
        assert 0 <= record["prm/accuracy"] <= 1 and record["prm/skipped_updates"] == 0
    assert records[-1]["prm/process_reward_mean"] != 0  # the PRM has moved away from the reference
    assert records[-1]["prm/process_reward_std"] > 0

    folder = tmp_path / "run" / "checkpoints" / "step_00000002"
    saved = ckpt.load_trainer_state(folder)["prm"]
    start = load_policy(tiny_model_dir).state_dict()
    assert max(float((saved["model"][k] - v).abs().max()) for k, v in start.items()) > 1e-4
    trainer = Trainer(load_config(PRIME, overrides), resume=True)
    try:
        restored = trainer.prm.state_dict()
    finally:
        trainer.lock.release()
    assert trainer.step == 2
    assert all(torch.equal(restored["model"][k], v) for k, v in saved["model"].items())
    moments = restored["optimizer"]["state"]
    assert moments and all(
        torch.equal(moments[i][name], value)
        for i, state in saved["optimizer"]["state"].items()
        for name, value in state.items()
    )
    assert restored["scheduler"] == saved["scheduler"]


@pytest.mark.slow
def test_prime_without_its_process_part_trains_as_rloo(tmp_path: Path, tiny_model_dir: Path) -> None:
    """The PRM's own update draws nothing from the stream the policy samples from: with c_p = 0, PRIME's
    rollouts and updates are RLOO's, step after step (its PRM still trains and scores)."""
    steps = ["trainer.total_steps=3"]
    prime_run = parity_run(tmp_path, tiny_model_dir, "prime", *steps, "algorithm.prime_process_coef=0")
    rloo_run = parity_run(tmp_path, tiny_model_dir, "rloo", *steps, "algorithm.adv_estimator=rloo")
    assert main(["train", str(PRIME), *prime_run]) == 0
    assert main(["train", str(PRIME), *rloo_run]) == 0
    prime_records = read_metrics(tmp_path / "prime" / "metrics.jsonl")
    rloo_records = read_metrics(tmp_path / "rloo" / "metrics.jsonl")
    assert [r["step"] for r in prime_records] == [r["step"] for r in rloo_records] == [1, 2, 3]
    assert all("prm/loss" in r for r in prime_records)
    for ours, theirs in zip(prime_records, rloo_records, strict=True):
        assert ours["reward/mean"] == theirs["reward/mean"]  # the same responses were sampled
        for key in ("actor/pg_loss", "actor/entropy", "actor/grad_norm"):
            assert ours[key] == pytest.approx(theirs[key], rel=1e-4, abs=1e-6), key
