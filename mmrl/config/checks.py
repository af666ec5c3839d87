"""The cross-field checks: combinations of sections that cannot run together, refused at start with what
to change.

Each check takes the sections it relates; `Config` (mmrl.config.run) runs them all on every validation,
in the order the errors are reported. They raise ValueError, which pydantic reports as the config's own.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from mmrl.config.agent import AgentConfig, GameConfig
from mmrl.config.data import DataConfig
from mmrl.config.rollout import RolloutConfig
from mmrl.config.trainer import TrainerConfig
from mmrl.config.training import ActorConfig, AlgorithmConfig, CriticConfig, WarmupConfig
from mmrl.config.vla import EnvConfig

if TYPE_CHECKING:
    from mmrl.algorithms.registry import Needs


def check_training_data(data: DataConfig, env: EnvConfig | None) -> None:
    """Prompt rows are the training data unless an env's episodes are."""
    if env is None and not data.train_files:
        raise ValueError("data.train_files is required: name the training data (or add an env section)")


def check_agent_supported(
    agent: AgentConfig, env: EnvConfig | None, rollout: RolloutConfig, algorithm: AlgorithmConfig
) -> None:
    """Agent trajectories are generated in the trainer's process, turn by turn."""
    refused = {
        "an env section": env is not None,
        "rollout.max_staleness > 0 or rollout.workers > 1 (agent rollouts run in the trainer's process)": (
            rollout.remote
        ),
        "algorithm.adv_estimator remax": algorithm.adv_estimator == "remax",
        "algorithm.overlong_buffer_len (it measures one turn's length; agent.max_tokens limits the whole)": algorithm.overlong_buffer_len
        > 0,
        "algorithm.policy_filtration (it filters single-turn prompts' responses)": algorithm.policy_filtration
        is not None,
    }
    hit = [name for name, bad in refused.items() if bad]
    if hit:
        raise ValueError(f"an agent section (multi-turn rollouts) does not combine with {'; '.join(hit)}")
    if bool(agent.tools) == (agent.game is not None):
        raise ValueError(
            "an agent section needs either agent.tools (tool calls) or agent.game (an env played turn by "
            "turn), not both and not neither"
        )
    vllm_len = rollout.vllm.max_model_len
    if rollout.engine != "hf" and agent.max_tokens > vllm_len:
        raise ValueError(
            f"agent.max_tokens ({agent.max_tokens}) exceeds rollout.vllm.max_model_len ({vllm_len}): "
            "vLLM would refuse a trajectory's later turns. Raise max_model_len or lower agent.max_tokens."
        )


def check_expert_noise(warmup: WarmupConfig, game: GameConfig | None) -> None:
    """Only a game has a scripted expert, and its moves are written into the warm-up turns."""
    if warmup.expert_noise is not None and (game is None or warmup.turns is None):
        raise ValueError("warmup.expert_noise plays a game's expert: it needs agent.game and warmup.turns")


def check_env_supported(
    data: DataConfig, warmup: WarmupConfig, algorithm: AlgorithmConfig, actor: ActorConfig
) -> None:
    """Episode training grades whole episodes, so settings that grade or warm up on answers are refused."""
    refused = {
        "data.train_files (episodes are the data)": bool(data.train_files),
        "warmup.steps > 0 (use `mmrl sft` to start from demos)": warmup.steps > 0,
        "algorithm.adv_estimator=remax (an episode has no greedy twin to compare with)": algorithm.adv_estimator
        == "remax",
        "algorithm.use_kl_in_reward (use actor.use_kl_loss)": algorithm.use_kl_in_reward,
        "algorithm.policy_filtration (it filters single-turn prompts' responses)": algorithm.policy_filtration
        is not None,
        "actor.rollout_correction (episodes keep no sampling log-probs)": actor.rollout_correction
        is not None,
    }
    hit = [name for name, bad in refused.items() if bad]
    if hit:
        raise ValueError(f"an env section (VLA episodes) does not combine with {'; '.join(hit)}")


def check_gigpo_states(algorithm: AlgorithmConfig, env: EnvConfig | None, game: GameConfig | None) -> None:
    """GiGPO groups decisions by the state they were made from, which only episodes have."""
    if env is None and algorithm.adv_estimator == "gigpo" and game is None:
        raise ValueError(
            "algorithm.adv_estimator=gigpo compares decisions made from the same state across the "
            "episodes of a group, so it needs an env section or a game (agent.game); use grpo for prompts"
        )


def check_mini_batches(data: DataConfig, actor: ActorConfig) -> None:
    """Each step's batch is split into whole optimizer mini-batches."""
    if data.train_batch_size % actor.mini_batch_size:
        raise ValueError(
            f"data.train_batch_size ({data.train_batch_size}) must be a multiple of "
            f"actor.mini_batch_size ({actor.mini_batch_size}); change one of them"
        )


def check_sampling(rollout: RolloutConfig) -> None:
    """Several greedy answers to one prompt are the same answer."""
    for name, sampling in (("rollout", rollout), ("rollout.val", rollout.val)):
        if sampling.n > 1 and sampling.temperature == 0:
            raise ValueError(
                f"{name}.n={sampling.n} with {name}.temperature=0 samples the same greedy answer n times; "
                f"set {name}.temperature > 0 or {name}.n=1"
            )


def check_lengths(data: DataConfig, rollout: RolloutConfig) -> None:
    """The longest prompt and response must fit vLLM's sequence length, or vLLM fails mid-run."""
    vllm_len = rollout.vllm.max_model_len
    if rollout.engine != "hf" and data.max_prompt_length + rollout.max_new_tokens > vllm_len:
        raise ValueError(
            f"data.max_prompt_length ({data.max_prompt_length}) + rollout.max_new_tokens "
            f"({rollout.max_new_tokens}) exceeds rollout.vllm.max_model_len ({vllm_len}): vLLM would "
            "reject the longest prompts mid-run. Raise max_model_len or lower one of the two "
            "(longer prompts are skipped and counted as prompt_too_long)."
        )


def check_registered_names(algorithm: AlgorithmConfig, actor: ActorConfig) -> None:
    """Estimators, losses and corrections are named by string, so a typo is caught here, not at step 1."""
    _check_registered("algorithm.adv_estimator", algorithm.adv_estimator, "ADVANTAGE_ESTIMATORS")
    _check_registered("actor.policy_loss", actor.policy_loss, "POLICY_LOSSES")
    if algorithm.policy_filtration is not None:
        _check_registered("algorithm.policy_filtration", algorithm.policy_filtration, "POLICY_FILTERS")
    if actor.rollout_correction is not None:
        _check_registered("actor.rollout_correction", actor.rollout_correction, "ROLLOUT_CORRECTIONS")


def _check_registered(key: str, name: str, registry: str) -> None:
    """Registered names and `path/to/file.py:function` specs pass; anything else fails at start."""
    from mmrl import algorithms

    known = getattr(algorithms, registry)
    if ":" not in name and name not in known:
        raise ValueError(
            f"{key}={name!r} is not registered; choose one of {', '.join(sorted(known))}, "
            "or name your own as path/to/file.py:function"
        )


def check_dapo(algorithm: AlgorithmConfig, rollout: RolloutConfig) -> None:
    """DAPO's dynamic sampling needs groups that can differ, and its overlong buffer a response to end."""
    if algorithm.dynamic_sampling and rollout.n == 1:
        raise ValueError(
            "algorithm.dynamic_sampling keeps only groups whose rewards differ, and a group of "
            "rollout.n=1 never differs; set rollout.n >= 2 or algorithm.dynamic_sampling=false"
        )
    if algorithm.overlong_buffer_len > rollout.max_new_tokens:
        raise ValueError(
            f"algorithm.overlong_buffer_len ({algorithm.overlong_buffer_len}) must not exceed "
            f"rollout.max_new_tokens ({rollout.max_new_tokens}); shorten the buffer"
        )


def check_critic_warmup(algorithm: AlgorithmConfig, critic: CriticConfig, trainer: TrainerConfig) -> None:
    """The critic's warm-up steps come out of the run's, and some must be left for the actor."""
    if (
        _needs("ADVANTAGE_ESTIMATORS", algorithm.adv_estimator).critic
        and critic.pretrain_steps >= trainer.total_steps
    ):
        raise ValueError(
            f"critic.pretrain_steps ({critic.pretrain_steps}) must be below trainer.total_steps "
            f"({trainer.total_steps}), or the actor never trains"
        )


def check_tensor_parallel(rollout: RolloutConfig, trainer: TrainerConfig) -> None:
    """A vLLM engine over `tp` ranks is built from that many Ray workers on one node (its ranks talk
    every layer), so each node's workers must split into whole engines."""
    tp = rollout.vllm.tensor_parallel_size
    per_node = trainer.n_gpus_per_node
    if tp > 1 and rollout.engine != "hf" and per_node % tp:
        raise ValueError(
            f"rollout.vllm.tensor_parallel_size={tp} splits each vLLM engine over {tp} Ray workers on one "
            f"node, and trainer.n_gpus_per_node={per_node} does not split into groups of {tp}. Set "
            f"trainer.n_gpus_per_node to a multiple of {tp}, or tensor_parallel_size=1."
        )


def check_staleness(rollout: RolloutConfig, env: EnvConfig | None, actor: ActorConfig) -> None:
    """Rollout workers of their own generate single-turn prompts, each on one GPU; beyond staleness 0 they
    sample from an older policy, which only a rollout correction accounts for."""
    if not rollout.remote:
        return
    what = f"rollout.max_staleness={rollout.max_staleness} rollout.workers={rollout.workers}"
    if env is not None:
        raise ValueError(
            f"{what}: VLA episodes are generated synchronously in the trainer; set rollout.max_staleness=0 "
            "and rollout.workers=1"
        )
    if rollout.vllm.tensor_parallel_size > 1 and rollout.engine != "hf":
        raise ValueError(
            f"{what} generates on rollout workers of one GPU each, so a vLLM engine cannot be split: set "
            "rollout.vllm.tensor_parallel_size=1"
        )
    k = rollout.max_staleness
    if k and actor.rollout_correction is None:
        raise ValueError(
            f"rollout.max_staleness={k} trains on rollouts sampled up to {k} updates ago: set "
            "actor.rollout_correction (tis is the usual choice) so the loss weights them by pi_old/pi_rollout"
        )


def _needs(registry: str, name: str) -> Needs:
    """What the registered `name` declares it needs; a user's `path/to/file.py:function` declares nothing
    (and is not imported while the config is read)."""
    from mmrl import algorithms

    return algorithms.Needs() if ":" in name else algorithms.needs_of(getattr(algorithms, registry)[name])


def check_group_size(algorithm: AlgorithmConfig, rollout: RolloutConfig) -> None:
    """Group baselines compare a prompt's responses with each other, so a group needs two, also after a
    policy filter has kept only some of them."""
    if not _needs("ADVANTAGE_ESTIMATORS", algorithm.adv_estimator).groups:
        return
    if rollout.n == 1:
        raise ValueError(
            f"algorithm.adv_estimator={algorithm.adv_estimator} compares responses within a "
            "group, so it needs rollout.n >= 2"
        )
    name = algorithm.policy_filtration
    kept = _needs("POLICY_FILTERS", name).rows_per_group if name else None
    if kept is not None and kept < 2:
        raise ValueError(
            f"algorithm.policy_filtration={name} keeps {kept} response per prompt, and "
            f"algorithm.adv_estimator={algorithm.adv_estimator} compares responses within a group: every "
            "advantage would be 0. Use best_worst or best_random, or an estimator without groups "
            "(gae, reinforce_plus_plus, remax)"
        )


def check_policy_filtration(algorithm: AlgorithmConfig, rollout: RolloutConfig) -> None:
    """A filter chooses among a prompt's responses, so there must be more than one."""
    if algorithm.policy_filtration is not None and rollout.n == 1:
        raise ValueError(
            f"algorithm.policy_filtration={algorithm.policy_filtration} chooses among each prompt's "
            "rollout.n responses, and rollout.n=1 leaves nothing to choose: set rollout.n >= 2 or "
            "algorithm.policy_filtration=null"
        )


def check_exact_on_policy(
    algorithm: AlgorithmConfig, actor: ActorConfig, data: DataConfig, rollout: RolloutConfig
) -> None:
    """An estimator that needs exact on-policy updates (OPO) gets one optimizer step per freshly
    sampled batch: then π_θ = π_old at the step, and the loss is the plain policy gradient."""
    if not _needs("ADVANTAGE_ESTIMATORS", algorithm.adv_estimator).exact_on_policy:
        return
    wrong = {
        f"actor.ppo_epochs=1 (not {actor.ppo_epochs})": actor.ppo_epochs != 1,
        f"actor.mini_batch_size={data.train_batch_size}, data.train_batch_size (not {actor.mini_batch_size})": (
            actor.mini_batch_size != data.train_batch_size
        ),
        f"rollout.max_staleness=0 (not {rollout.max_staleness})": rollout.max_staleness != 0,
    }
    fixes = [fix for fix, bad in wrong.items() if bad]
    if fixes:
        raise ValueError(
            f"algorithm.adv_estimator={algorithm.adv_estimator} trains exactly on-policy: one optimizer step "
            f"on each freshly sampled batch. Set {'; '.join(fixes)}"
        )


def check_pairings(algorithm: AlgorithmConfig, actor: ActorConfig) -> None:
    """An estimator and a loss that are two halves of one method name each other in their registry
    entries (`Needs.pairs_with`); either half with anything else trains on the wrong target."""
    estimator, loss = algorithm.adv_estimator, actor.policy_loss
    wants_loss = _needs("ADVANTAGE_ESTIMATORS", estimator).pairs_with
    wants_estimator = _needs("POLICY_LOSSES", loss).pairs_with
    if wants_loss not in (None, loss):
        raise ValueError(
            f"algorithm.adv_estimator={estimator} is one half of a pair: set actor.policy_loss={wants_loss} "
            f"(not {loss})"
        )
    if wants_estimator not in (None, estimator):
        raise ValueError(
            f"actor.policy_loss={loss} is one half of a pair: set algorithm.adv_estimator={wants_estimator} "
            f"(not {estimator})"
        )


def check_critic_options(algorithm: AlgorithmConfig) -> None:
    """VAPO's λ options shape the advantages of an estimator with a critic; elsewhere they would do
    nothing, so they are refused rather than ignored."""
    if _needs("ADVANTAGE_ESTIMATORS", algorithm.adv_estimator).critic:
        return
    set_keys = {
        "algorithm.critic_lam": algorithm.critic_lam,
        "algorithm.length_adaptive_alpha": algorithm.length_adaptive_alpha,
    }
    named = [key for key, value in set_keys.items() if value is not None]
    if named:
        raise ValueError(
            f"{' and '.join(named)} set GAE's λ for a learned critic, and "
            f"algorithm.adv_estimator={algorithm.adv_estimator} has none: use algorithm.adv_estimator=gae "
            f"or leave {' and '.join(named)} unset"
        )


def check_prm(algorithm: AlgorithmConfig, env: EnvConfig | None, agent: AgentConfig | None) -> None:
    """PRIME's implicit PRM scores the responses to prompts, whose advantages the prompt source computes;
    its two weights must leave something to learn from."""
    if not _needs("ADVANTAGE_ESTIMATORS", algorithm.adv_estimator).prm:
        return
    name = algorithm.adv_estimator
    if env is not None or agent is not None:
        section = (
            "an env section (VLA episodes)" if env is not None else "an agent section (multi-turn rollouts)"
        )
        raise ValueError(
            f"algorithm.adv_estimator={name} rewards the tokens of single-turn responses with its implicit PRM, "
            f"and {section} has none: use grpo or rloo there"
        )
    if algorithm.prime_outcome_coef == 0 and algorithm.prime_process_coef == 0:
        raise ValueError(
            f"algorithm.adv_estimator={name} with algorithm.prime_outcome_coef=0 and "
            "algorithm.prime_process_coef=0 gives every token advantage 0: set one of them above 0 (the paper: 1 and 1)"
        )
