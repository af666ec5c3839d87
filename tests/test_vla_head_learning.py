"""The continuous VLA policies learn on CPU (configs/vla_mujoco_reach.yaml with `sft.policy: gaussian` or
`flow`, at the size `learning_runs.RUNS["vla_<kind>"]` gives): a tiny random-init Qwen2.5-VL with a fresh
head, which acts at random, is behaviour-cloned from the expert's actions (L1 for the Gaussian head, flow
matching for the expert), then trained with episode GRPO over its sampled chunks or denoising chains, and
succeeds on evaluation seeds that training never meets. RL's own lift needs more steps than a CI run has:
bench/vla_heads.py measures it (docs/benchmarks.md); here RL must keep what was cloned.
"""

from __future__ import annotations

import pytest
from learning_runs import RUNS, train, validations

pytestmark = pytest.mark.slow

# Sampled success over 50 evaluation episodes; see each run's measured spread in docs/benchmarks.md.
MIN_SUCCESS = {"gaussian": 0.04, "flow": 0.04}


@pytest.mark.parametrize("kind", ["gaussian", "flow"])
def test_a_cloned_head_policy_reaches_and_rl_keeps_it(tmp_path, tiny_model_dir, kind) -> None:
    run = RUNS[f"vla_{kind}"]
    records = train(f"vla_{kind}", tmp_path, tiny_model_dir)
    (first_step, cloned), (last_step, trained) = validations(records, run.metric)
    print(f"{kind} reach success: after SFT {cloned:.2f}, after {last_step} RL steps {trained:.2f}")
    assert (first_step, last_step) == (0, run.steps)
    assert all(r["actor/rollout_logprob_diff"] < 1e-5 for r in records if "actor/rollout_logprob_diff" in r)
    assert trained >= MIN_SUCCESS[kind], f"success {cloned} (SFT) -> {trained} (RL)"
    assert trained - cloned >= run.min_gain, f"RL lost what was cloned: {cloned} -> {trained}"
