"""Ray worker groups with FSDP2 on a real local Ray cluster and real gloo process groups.

Parity: one update of the same global batch gives the same weights in one process and in two
FSDP workers, for full fine-tuning and for LoRA, and so do the GAE critic's values and update and
PRIME's implicit PRM's update and rewards. The
workers also generate, score log-probs and checkpoint; the trainer runs through them end to end on a
fake two-node cluster.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import ray
import torch
from helpers import tiny_vla_config
from ray.cluster_utils import Cluster

from mmrl.config import load_config
from mmrl.data.sample import PromptSample
from mmrl.data.synthetic import generate
from mmrl.errors import ResourceError, WorkerError
from mmrl.models import SHARDED_MARKER, load_policy, load_processor
from mmrl.processors import build_messages, encode_prompt
from mmrl.rollout import HFEngine, SamplingParams, cpu_shm
from mmrl.rollout.vllm import vllm_available
from mmrl.run import checkpoint as ckpt
from mmrl.run.logger import read_metrics
from mmrl.sources.prompts import build_datasets
from mmrl.trainer import Trainer
from mmrl.training.actor import build_actor, update_plan
from mmrl.training.critic import build_critic, critic_plan, value_model
from mmrl.training.lora import apply_lora, gather_shards, load_with_adapter
from mmrl.training.micro_batches import deal, pack_rows, row_lengths
from mmrl.training.prm import build_prm, prm_model, prm_plan
from mmrl.workers.group import PolicyGroup

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("ray")]


def _cfg(model: Path, data: Path, *extra: str):
    return load_config(
        "configs/quickstart.yaml",
        [
            f"model.path={model}",
            f"data.train_files={data / 'train.jsonl'}",
            "data.val_files=[]",
            "data.train_batch_size=4",
            "actor.mini_batch_size=2",  # two optimizer steps per update
            "actor.micro_batch_size=3",  # shares of 4 rows: micro-batches of 3 and 1 on each rank
            "actor.lr=1e-3",
            "actor.warmup_steps=0",
            "actor.max_grad_norm=0.05",  # clipping on: the global norm must be the one-process norm
            "rollout.n=4",
            "warmup.steps=0",
            "trainer.n_gpus_per_node=2",
            *extra,
        ],
    )


def _scored_batch(cfg, text_only: tuple[int, ...] = ()):
    """A fixed rollout batch with advantages and reference log-probs, made in this process; the prompts
    at `text_only` are asked without their image."""
    torch.manual_seed(0)
    model = load_policy(cfg.model.path)
    processor = load_processor(cfg.model.path)
    train, _ = build_datasets(cfg, processor, model.config)
    prompts = train.prepare_all(limit=4)
    for i in text_only:
        ids = encode_prompt(processor.tokenizer, build_messages("How many circles are there?", 0), [])
        prompts[i] = PromptSample(prompts[i].row_id, ids, "q", prompts[i].ground_truth)
    batch = HFEngine(model, processor).generate(
        prompts, SamplingParams(n=4, temperature=1.0, max_new_tokens=8)
    )
    shape = batch["response_mask"].shape
    batch.set(advantages=torch.randn(shape[0], 1).expand(shape).clone())
    batch.set(ref_logprobs=-torch.rand(shape))
    return batch


def _one_process_update(cfg, batch, plan) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    torch.manual_seed(cfg.trainer.seed)
    model = load_policy(cfg.model.path)
    peft = apply_lora(model, cfg.model.lora) if cfg.model.lora.rank else None
    actor = build_actor(cfg, model, load_processor(cfg.model.path).tokenizer.pad_token_id, torch.float32)
    base_logprobs = actor.logprobs(batch)  # before the update: the start, i.e. the reference
    actor.update(batch, plan)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    return {k: v for k, v in model.state_dict().items() if peft is None or k in trainable}, base_logprobs


def _ranks_differ_in_media(batch, plan, ranks: int = 2, micro: int = 3) -> bool:
    """Whether some micro-batch has images on one rank and none on another: each rank takes an equal
    share of a mini-batch's rows, in order (`PolicyGroup`), cut into micro-batches of `micro` rows."""
    for step in plan:
        shares = step.rows.tensor_split(ranks)
        for start in range(0, len(shares[0]), micro):
            has = {
                any(batch.prompts[int(batch["prompt_index"][r])].images for r in s[start : start + micro])
                for s in shares
            }
            if len(has) > 1:
                return True
    return False


def _two_worker_update(cfg, batch, plan):
    """Weights before and after one update on two FSDP workers, its stats, and the reference's scores."""
    group = PolicyGroup(cfg)
    try:
        before = group.state()
        stats = group.update(batch, plan)
        return before, stats, group.state(), group.ref_logprobs(batch)
    finally:
        group.shutdown()


# Qwen3-VL-MoE runs the dense Qwen3-VL adapter's vision and text paths plus its experts, so it stands
# for both (a minute of the suite's budget per case saved); LLaVA-OneVision stands for the LLaVA layout
# (`mmrl.models.llava`: InternVL, Gemma 3, Mistral 3), its SigLIP layers and its projector. A family's
# FSDP units are the same with and without LoRA, so the MoE runs under LoRA only (the worst case: LoRA
# on the experts' layers) and Qwen2.5-VL in full only (its LoRA on FSDP workers: the two-node and
# tensor-parallel tests below); 40 s a case.
@pytest.mark.parametrize(
    "family, lora",
    [("qwen2_5_vl", False), ("qwen3_vl_moe", True), ("llava_onevision", False), ("llava_onevision", True)],
    ids=["full-qwen2_5_vl", "lora-qwen3_vl_moe", "full-llava_onevision", "lora-llava_onevision"],
)
def test_two_fsdp_workers_update_exactly_like_one_process(
    local_ray, tmp_path, tiny_family_dir, family, lora
) -> None:
    """Per family: its FSDP units (`Family.fsdp_units`, MoE experts inside their layers) and LoRA prefixes.
    One prompt of the four is text-only, so some micro-batches hold images on one rank and none on the
    other: the vision blocks' collectives must still pair up (`mmrl.training.media`), or the ranks wait on
    each other until the group's timeout (shortened here)."""
    generate(tmp_path / "data", task="color", n_train=8, n_val=0, seed=0, image_size=56)
    extra = ["model.lora.rank=4"] if lora else []
    cfg = _cfg(tiny_family_dir(family), tmp_path / "data", *extra, "trainer.dist_timeout_s=60")
    batch = _scored_batch(cfg, text_only=(1,))
    torch.manual_seed(1)
    plan = update_plan(cfg).minibatches(batch)
    assert len(plan) == 2
    assert _ranks_differ_in_media(batch, plan), "the plan must give one rank a micro-batch without images"

    expected, base_logprobs = _one_process_update(cfg, batch, plan)
    before, stats, after, reference = _two_worker_update(cfg, batch, plan)

    assert stats.steps == 2 and stats.skipped_steps == 0
    assert set(after) == set(expected), (
        sorted(set(after) - set(expected))[:5],
        sorted(set(expected) - set(after))[:5],
    )
    moved = max(float((after[k] - before[k]).abs().max()) for k in after)
    assert moved > 1e-3, "the update should move the weights well beyond the tolerance"
    worst = max(float((after[k] - expected[k]).abs().max()) for k in after)
    # 2.8e-7 to 2.6e-6, and 1.07e-5 for LoRA on the MoE (4.1e-6 with every prompt showing its image):
    # the ranks' micro-batches sum in another order than one process's (2026-12-07)
    assert worst < 2e-5, f"2 FSDP workers differ from 1 process by {worst:.2e}"
    # The reference is the untouched start: under LoRA the workers' base with the adapter off.
    torch.testing.assert_close(reference, base_logprobs, rtol=0, atol=1e-5)


def test_token_budget_workers_update_and_score_like_one_process(local_ray, tmp_path, tiny_model_dir) -> None:
    """`actor.max_tokens_per_micro_batch`: the ranks' shares are balanced by tokens, not rows, and each
    rank runs as many micro-batches as the other (FSDP); weights and scores are still one process's. The
    rows run packed (`actor.padding_free`), each prompt once before its responses, as budgets are used."""
    generate(tmp_path / "data", task="color", n_train=8, n_val=0, seed=0, image_size=56)
    cfg = _cfg(tiny_model_dir, tmp_path / "data")
    batch = _scored_batch(cfg)
    width = batch["response_mask"].shape[1]
    mask = batch["response_mask"] * (torch.arange(width) < (torch.arange(len(batch)) % (width + 1))[:, None])
    batch.set(response_mask=mask)  # responses of 0 to 8 tokens: uneven shares and micro-batch counts
    cfg.actor.max_tokens_per_micro_batch = budget = 160  # 4 rows of 35-token prompts and short answers
    cfg.actor.padding_free = True
    torch.manual_seed(1)
    plan = update_plan(cfg).minibatches(batch)
    lengths = row_lengths(batch)
    shares = [[lengths[i] for i in step.rows.tolist()] for step in plan]
    uneven = [len({len(pack_rows(sub, rows, budget)) for rows in deal(sub, 2)}) > 1 for sub in shares]
    assert any(uneven), "a rank should split a micro-batch to match the other rank's count"

    expected, base_logprobs = _one_process_update(cfg, batch, plan)
    _, stats, after, reference = _two_worker_update(cfg, batch, plan)

    assert stats.steps == 2 and stats.skipped_steps == 0
    worst = max(float((after[k] - expected[k]).abs().max()) for k in after)
    assert worst < 1e-5, f"2 FSDP workers differ from 1 process by {worst:.2e}"
    torch.testing.assert_close(reference * mask, base_logprobs * mask, rtol=0, atol=1e-5)


def test_sharded_checkpoint_exports_whole_and_resumes_exactly(local_ray, tmp_path, tiny_model_dir) -> None:
    generate(tmp_path / "data", task="color", n_train=8, n_val=0, seed=0, image_size=56)
    cfg = _cfg(tiny_model_dir, tmp_path / "data")
    batch = _scored_batch(cfg)
    first, second = update_plan(cfg).minibatches(batch), update_plan(cfg).minibatches(batch)
    folder = tmp_path / "ckpt"
    group = PolicyGroup(cfg)
    try:
        group.update(batch, first)
        group.save(folder)
        saved = group.state()
        group.update(batch, second)
        continued = group.state()
    finally:
        group.shutdown()

    exported = gather_shards(folder / "model").state_dict()
    assert all(torch.equal(exported[k], saved[k]) for k in saved)
    with pytest.raises(FileNotFoundError, match="mmrl export"):
        load_policy(folder / "model")

    resumed = PolicyGroup(cfg)
    try:
        resumed.load(folder)
        assert all(torch.equal(v, saved[k]) for k, v in resumed.state().items())
        resumed.update(batch, second)  # the same step again: AdamW moments and schedule were restored too
        again = resumed.state()
    finally:
        resumed.shutdown()
    assert all(torch.equal(again[k], continued[k]) for k in continued)


def test_two_workers_critic_values_update_and_resume_like_one_process(
    local_ray, tmp_path, tiny_model_dir
) -> None:
    """GAE on workers: the critic's FSDP2 shards live on the policy's ranks. Values before and after one
    critic update equal one process's, under a token budget (token-balanced shares, as the actor's);
    a checkpoint restores weights, AdamW moments and schedule, so the next update is the same."""
    generate(tmp_path / "data", task="color", n_train=8, n_val=0, seed=0, image_size=56)
    cfg = _cfg(
        tiny_model_dir,
        tmp_path / "data",
        "algorithm.adv_estimator=gae",
        "critic.lr=1e-3",
        "critic.max_grad_norm=0.05",
        "actor.max_tokens_per_micro_batch=160",
    )
    batch = _scored_batch(cfg)
    batch.set(values=torch.zeros_like(batch["advantages"]), returns=torch.randn(batch["advantages"].shape))
    torch.manual_seed(1)
    plan = update_plan(cfg)
    first, second = critic_plan(cfg, batch, plan), critic_plan(cfg, batch, plan)
    assert len(first) == 2

    # The head starts at zero: the first step moves the head only, the second the trunk through it.
    model = value_model(cfg, cfg.model.path, "cpu")
    critic = build_critic(cfg, model, load_processor(cfg.model.path).tokenizer.pad_token_id, torch.float32)
    expected_before = critic.values(batch)
    critic.update(batch, first)
    expected_after = critic.values(batch)

    folder = tmp_path / "ckpt"
    group = PolicyGroup(cfg)
    try:
        before = group.critic.values(batch)
        stats = group.critic.update(batch, first)
        after = group.critic.values(batch)
        group.save(folder)
        saved = group.critic.state()
        group.critic.update(batch, second)
        continued = group.critic.state()
        # The same workers load the checkpoint from disk (a fresh pair would cost the suite another
        # start-up; the loading path is the one a resumed run takes).
        group.load(folder)
        assert all(torch.equal(v, saved[k]) for k, v in group.critic.state().items())
        group.critic.update(batch, second)
        again = group.critic.state()
    finally:
        group.shutdown()

    assert stats.steps == 2 and stats.skipped_steps == 0
    assert float((expected_after - expected_before).abs().max()) > 1e-3, "the update should move V"
    worst = max(float((before - expected_before).abs().max()), float((after - expected_after).abs().max()))
    worst = max(worst, *(float((saved[k] - v).abs().max()) for k, v in critic.model.state_dict().items()))
    assert worst < 1e-5, f"2 FSDP workers' critic differs from 1 process by {worst:.2e}"

    assert all(torch.equal(again[k], continued[k]) for k in continued)


def test_two_workers_prm_update_rewards_and_resume_like_one_process(
    local_ray, tmp_path, tiny_model_dir
) -> None:
    """PRIME on workers: the implicit PRM's FSDP2 shards live on the policy's ranks. Its process rewards
    before and after an update of two optimizer steps on outcome labels equal one process's, and so do
    its weights and loss; a checkpoint restores weights, AdamW moments and schedule, so the next update
    is the same."""
    generate(tmp_path / "data", task="color", n_train=8, n_val=0, seed=0, image_size=56)
    cfg = _cfg(
        tiny_model_dir,
        tmp_path / "data",
        "algorithm.adv_estimator=prime",
        "prm.lr=1e-3",
        "prm.max_grad_norm=0.05",  # clipping on: the global norm must be the one-process norm
    )
    batch = _scored_batch(cfg)
    batch.set(scores=(torch.arange(len(batch)) % 2).float())  # outcome labels 0 and 1 in every mini-batch
    torch.manual_seed(1)
    first, second = prm_plan(cfg, batch), prm_plan(cfg, batch)
    assert len(first) == 2

    model = prm_model(cfg, cfg.model.path)
    prm = build_prm(cfg, model, load_processor(cfg.model.path).tokenizer.pad_token_id, torch.float32)
    expected_before = prm.rewards(batch)
    expected_stats = prm.update(batch, first)
    expected_after = prm.rewards(batch)

    folder = tmp_path / "ckpt"
    group = PolicyGroup(cfg)
    try:
        before = group.prm.rewards(batch)
        stats = group.prm.update(batch, first)
        after = group.prm.rewards(batch)
        group.save(folder)
        saved = group.prm.state()
        group.prm.update(batch, second)
        continued = group.prm.state()
        group.load(folder)  # the same workers load it from disk, the path a resumed run takes
        assert all(torch.equal(v, saved[k]) for k, v in group.prm.state().items())
        group.prm.update(batch, second)
        again = group.prm.state()
    finally:
        group.shutdown()

    assert stats.steps == 2 and stats.skipped_steps == 0
    assert float((expected_after - expected_before).abs().max()) > 1e-3, "the update should move the rewards"
    worst = max(float((before - expected_before).abs().max()), float((after - expected_after).abs().max()))
    worst = max(worst, *(float((saved[k] - v).abs().max()) for k, v in model.state_dict().items()))
    assert worst < 1e-5, f"2 FSDP workers' PRM differs from 1 process by {worst:.2e}"
    assert abs(stats.metrics["prm/loss"] - expected_stats.metrics["prm/loss"]) < 1e-5
    assert all(torch.equal(again[k], continued[k]) for k in continued)


def _run_overrides(model: Path, data: Path, out: Path, steps: int, *extra: str) -> list[str]:
    return [
        f"model.path={model}",
        f"data.train_files={data / 'train.jsonl'}",
        "data.val_files=[]",
        "data.train_batch_size=4",
        "actor.mini_batch_size=4",
        "rollout.n=4",
        "warmup.steps=2",
        "warmup.batch_size=8",
        f"trainer.output_dir={out}",
        f"trainer.total_steps={steps}",
        "trainer.save_every=2",
        "trainer.val_every=0",
        "trainer.progress=false",
        "trainer.loggers=[jsonl]",
        *extra,
    ]


def test_trainer_places_lora_workers_on_both_nodes_of_a_two_node_cluster(
    no_ray, tmp_path, tiny_model_dir
) -> None:
    """`ray.cluster_utils.Cluster` fakes two nodes on this machine: separate raylets, one CPU each."""
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
    cluster.add_node(num_cpus=1)
    cluster.wait_for_nodes()
    generate(tmp_path / "data", task="color", n_train=16, n_val=0, seed=0, image_size=56)
    overrides = _run_overrides(
        tiny_model_dir,
        tmp_path / "data",
        tmp_path / "run",
        2,
        "trainer.nnodes=2",
        "trainer.n_gpus_per_node=1",
        f"trainer.ray_address={cluster.address}",
        "model.lora.rank=4",
        "actor.lr=1e-2",
    )
    try:
        trainer = Trainer(load_config("configs/quickstart.yaml", overrides))
        nodes = trainer.policy.nodes
        trainer.fit()
    finally:
        ray.shutdown()
        cluster.shutdown()
    assert len(set(nodes)) == 2, f"both workers landed on one node: {nodes}"
    assert [r["step"] for r in read_metrics(tmp_path / "run" / "metrics.jsonl")] == [1, 2]
    folder = tmp_path / "run" / "checkpoints" / "step_00000002"
    assert ckpt.is_complete(folder)
    # The LoRA adapter is also written in peft's format: plain transformers loads it onto its base.
    ids = torch.tensor([[5, 17, 42, 99, 7, 3]])
    with torch.no_grad():
        plain, merged, base = (
            m.eval()(input_ids=ids).logits
            for m in (
                load_with_adapter(folder / "model"),
                gather_shards(folder / "model"),
                load_policy(tmp_path / "run" / "warmup_model"),
            )
        )
    assert float((merged - base).abs().max()) > 1e-3, "the adapters should have moved the policy"
    torch.testing.assert_close(plain, merged, rtol=0, atol=1e-5)


KILLER = """
import json, os, pathlib, signal

STATE = pathlib.Path(__file__).with_name("kill.json")


def reward(sample):
    state = json.loads(STATE.read_text())
    state["calls"] += 1
    if state["calls"] == state["at"]:
        os.kill(state["pid"], signal.SIGKILL)
    STATE.write_text(json.dumps(state))
    return float(len(sample.response) % 3) / 2
"""


def test_a_killed_worker_stops_the_run_naming_it_and_the_step_and_resume_continues(
    local_ray, tmp_path, tiny_model_dir
) -> None:
    data = tmp_path / "data"
    generate(data, task="color", n_train=16, n_val=0, seed=0, image_size=56)
    (data / "killer.py").write_text(KILLER)
    overrides = _run_overrides(
        tiny_model_dir,
        data,
        tmp_path / "run",
        4,
        "trainer.n_gpus_per_node=2",
        f"reward.functions=[{{name: '{data / 'killer.py'}:reward'}}]",
        "reward.isolation=inline",  # `reward` counts its calls in a file: one process must make them all
    )
    cfg = load_config("configs/quickstart.yaml", overrides)
    trainer = Trainer(cfg)
    victim = trainer.policy.group.places[1]["pid"]
    rows_per_step = 4 * 4
    (data / "kill.json").write_text(json.dumps({"calls": 0, "at": 2 * rows_per_step + 1, "pid": victim}))
    started = time.monotonic()
    with pytest.raises(WorkerError) as stopped:
        trainer.fit()
    message = str(stopped.value)
    assert message.startswith("step 3: actor worker 1")
    assert f"pid {victim}" in message and "died" in message and "--resume" in message
    assert time.monotonic() - started < 120, "a dead worker must stop the run, not hang it"
    root = tmp_path / "run" / "checkpoints"
    assert [p.name for p in ckpt.list_checkpoints(root)] == ["step_00000002"]

    (data / "kill.json").write_text(json.dumps({"calls": 0, "at": -1, "pid": victim}))
    Trainer(cfg, resume=True).fit()
    assert [r["step"] for r in read_metrics(tmp_path / "run" / "metrics.jsonl")] == [1, 2, 3, 4]
    assert ckpt.latest_checkpoint(root).name == "step_00000004"


def test_asking_for_more_workers_than_the_cluster_holds_fails_at_once(
    local_ray, tmp_path, tiny_model_dir
) -> None:
    generate(tmp_path / "data", task="color", n_train=8, n_val=0, seed=0, image_size=56)
    cfg = _cfg(tiny_model_dir, tmp_path / "data", "trainer.n_gpus_per_node=3")
    started = time.monotonic()
    with pytest.raises(ResourceError, match=r"needs 1 node\(s\) with 3 CPU each.*1 node\(s\).*2 CPUs"):
        PolicyGroup(cfg)
    assert time.monotonic() - started < 10


def test_lora_workers_share_one_tensor_parallel_vllm_engine_fed_from_their_shards(
    local_ray, tmp_path, tiny_model_dir
) -> None:
    """`rollout.vllm.tensor_parallel_size=2`: the two workers are the two ranks of one real vLLM-CPU engine
    (vLLM's external launcher over the workers' gloo group). Each rank holds half of every split weight;
    both take the same prompts and sample the same rows, of which the controller keeps one copy. After an
    update the whole weights (LoRA merged) are gathered from the FSDP shards into both ranks, which keep
    their halves: every sync is verified against the trainer's forward, and the trainer's log-probs of
    what the engine then samples equal the engine's. (One engine per worker runs in tests/test_geo_recipe.py.)"""
    if not vllm_available():
        pytest.skip("vLLM is not installed (the vllm-cpu extra)")
    generate(tmp_path / "data", task="color", n_train=8, n_val=0, seed=0, image_size=56)
    cfg = _cfg(
        tiny_model_dir,
        tmp_path / "data",
        "model.lora.rank=4",
        "actor.lr=1e-2",
        "rollout.engine=vllm",
        "rollout.vllm.max_model_len=512",
        "rollout.vllm.tensor_parallel_size=2",
        "rollout.vllm.verify_sync_every=1",  # every sync is checked against the trainer's forward
        "rollout.vllm.enforce_eager=true",  # no C++ compilation on each rank
    )
    model = load_policy(cfg.model.path)
    prompts = build_datasets(cfg, load_processor(cfg.model.path), model.config)[0].prepare_all(limit=3)
    params = SamplingParams(n=2, temperature=1.0, max_new_tokens=8, logprobs=True)

    def gate_up_rows(worker) -> int:  # runs in a worker: the rows of the first decoder MLP its engine holds
        slices = worker.engine.llm.apply_model(
            lambda m: [
                u.output_size_per_partition for n, u in m.named_modules() if n.endswith("0.mlp.gate_up_proj")
            ]
        )
        return slices[0][-1]  # the vision tower's block comes first, the language model's last

    # What a killed engine leaves behind (vLLM 0.32 names the segments so in every external-launcher run):
    # startup used to fail on it with 'create shm in SHMManager failed. errno: 17'.
    for rank in (0, 1):
        (cpu_shm.SHM / f"-tp:0-[0-1]-cpushm_{rank}").write_bytes(b"")
    group = PolicyGroup(cfg)
    try:
        left = sorted(cpu_shm.SHM.glob(cpu_shm.PATTERN))
        assert not left, f"the running engine's shared memory should have no name left to collide on: {left}"
        gate_up = ray.get([w.__ray_call__.remote(gate_up_rows) for w in group.group.workers])
        full = 2 * model.config.text_config.intermediate_size
        assert gate_up == [full // 2, full // 2], f"each rank should hold half of {full} rows: {gate_up}"

        group.sync_weights()  # first sync: verified
        batch = group.generate(prompts, params)
        assert batch["response_ids"].shape[0] == 6 and batch["prompt_index"].tolist() == [0, 0, 1, 1, 2, 2]
        shape = batch["response_mask"].shape
        batch.set(advantages=torch.randn(shape[0], 1).expand(shape).clone())
        batch.set(ref_logprobs=group.ref_logprobs(batch))
        batch.set(old_logprobs=group.logprobs(batch))
        torch.manual_seed(1)
        group.update(batch, update_plan(cfg).minibatches(batch))
        group.sync_weights()  # the trained weights: verified again

        again = group.generate(prompts, params)
        mask = again["response_mask"].bool()
        gap = float((group.logprobs(again) - again["rollout_logprobs"])[mask].abs().max())
        assert gap < 1e-3, f"vLLM sampled from other weights than the trainer holds: {gap:.2e}"
        moved = float(
            (group.logprobs(batch) - batch["old_logprobs"])[batch["response_mask"].bool()].abs().max()
        )
        assert moved > 1e-2, "the update should have changed the policy"
    finally:
        group.shutdown()


def test_episode_training_runs_on_two_fsdp_workers(local_ray, tmp_path, tiny_model_dir) -> None:
    """VLA episodes with the policy sharded over two Ray workers: the controller steps the envs and
    the workers generate every decision and update; the checkpoint carries the action tokenizer."""
    cfg = tiny_vla_config(
        tiny_model_dir,
        tmp_path / "run",
        "trainer.n_gpus_per_node=2",
        "env.val_episodes=2",
        "env.media_episodes=1",
        "trainer.total_steps=1",
        "trainer.val_every=1",
    )
    Trainer(cfg).fit()
    record = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[-1])
    assert record["actor/updates"] == 1 and "val/success" in record and record["episode/episode_length"] > 0
    model = tmp_path / "run" / "checkpoints" / "step_00000001" / "model"
    assert (model / SHARDED_MARKER).exists() and (model / "action_tokenizer.json").exists()
