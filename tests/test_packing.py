"""The forwards that skip repeated work give the padded path's log-probs and gradients on every family that
can take them: rows with images, videos, text only and a mixed batch, with responses of different lengths
(one of them empty, as a truncated row's mask is).
- Padding-free packing (`actor.padding_free`, `mmrl.training.packing`). Qwen3.5's recurrent layers cannot
  keep packed rows apart on transformers' PyTorch kernels, so it refuses.
- The shared prompt (`mmrl.training.shared_prompt`): each prompt run once for its responses. Qwen3.5's
  recurrent state is not keys and values, so it keeps the padded forward.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from itertools import pairwise
from unittest import mock

import pytest
import torch
from family_cases import media_at

from mmrl.config import ActorConfig, Config, CriticConfig
from mmrl.data.batch import Batch
from mmrl.data.sample import PromptSample
from mmrl.errors import ConfigError
from mmrl.models import family_of, load_policy, load_processor, tokenizer_of
from mmrl.processors import build_messages, encode_prompt
from mmrl.training.actor import Actor, build_actor
from mmrl.training.critic import Critic, ValueModel
from mmrl.training.forward import forward_logprobs
from mmrl.training.optim import plan_minibatches
from mmrl.training.packing import PACKS_FROM_WIDTH, pack, runs_packed
from mmrl.training.segments import Segment, SegmentPlan

VL_FAMILIES = ["qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe", "glm4v", "glm4v_moe"]
CASES = {"images": ["image", "images"], "video": ["video"], "text": ["text"], "mixed": None}
WIDTH = 9  # the longest response


def _batch(prompts: list[PromptSample], seed: int) -> Batch:
    """Two responses per prompt of different lengths (WIDTH down to 0) with random ordinary tokens."""
    rows = [i for i in range(len(prompts)) for _ in range(2)]
    gen = torch.Generator().manual_seed(seed)
    response = torch.randint(100, 900, (len(rows), WIDTH), generator=gen)
    lengths = torch.tensor([WIDTH - (3 * r) % (WIDTH + 1) for r in range(len(rows))])
    mask = (torch.arange(WIDTH)[None] < lengths[:, None]).long()
    return Batch(
        tensors={"prompt_index": torch.tensor(rows), "response_ids": response * mask, "response_mask": mask},
        prompts=prompts,
    )


def _prompts(tiny_family_dir, name: str, cases: list[str] | None, system: str | None = None):
    """The tiny model of family `name`, its processor, and the family tests' prompts of `cases` (all),
    after a `system` prompt if given."""
    folder = tiny_family_dir(name)
    model, processor = load_policy(folder), load_processor(folder)
    family = family_of(model)
    media = media_at(family.tiny_grid_factor)
    prompts = [
        media.prompt(processor, family, i, c, system=system) for i, c in enumerate(cases or media.cases)
    ]
    return model, processor, prompts


def _forward_backward(
    model, batch: Batch, pad_id: int, padding_free: bool, shared: bool = False, router=True
):
    """Masked log-probs, every parameter's gradient of their sum, and an MoE model's router loss (`router`).
    Without `shared` each response runs its own copy of its prompt, as the plain padded forward does."""
    model.zero_grad(set_to_none=True)
    routers = [] if router and family_of(model).mixture_of_experts else None
    with _sharing(shared):
        logp, _ = forward_logprobs(model, batch, pad_id, router_losses=routers, padding_free=padding_free)
    mask = batch["response_mask"].bool()
    (logp * mask).sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return logp.detach()[mask], grads, float(routers[0].detach()) if routers else None


@contextmanager
def _sharing(on: bool) -> Iterator[None]:
    """With `on`, the forward shares prompts, and the test checks that it did; without, every response
    runs its own copy of its prompt, as the plain padded forward does."""
    from mmrl.training import forward

    if not on:
        with mock.patch.object(forward, "shared_prompts", return_value=None):
            yield
        return
    found, real = [], forward.shared_prompts
    with mock.patch.object(
        forward, "shared_prompts", lambda *a, **k: found.append(real(*a, **k)) or found[-1]
    ):
        yield
    assert any(s is not None for s in found), "the forward should have shared the prompts"


def _assert_packed_equals_padded(
    model, batch: Batch, pad_id: int, shared: bool = False, packed: bool | None = None
) -> None:
    """Packed (by default without `shared`) or shared-prompt forwards' log-probs agree with the plain padded
    forward's to 1e-5; every parameter's gradient and the router loss agree to 1e-5 relative (vision
    tower, language model, LM head)."""
    packed = not shared if packed is None else packed
    padded, padded_grads, padded_router = _forward_backward(model, batch, pad_id, False, router=not shared)
    other, other_grads, other_router = _forward_backward(
        model, batch, pad_id, packed, shared=shared, router=not shared
    )
    diff = float((other - padded).abs().max())
    assert diff < 1e-5, f"max |packed - padded| log-prob = {diff:.2e}"
    assert padded_grads.keys() == other_grads.keys()
    worst = max(
        float((a - other_grads[n]).norm() / a.norm().clamp(min=1e-12)) for n, a in padded_grads.items()
    )
    assert worst < 1e-5, f"largest relative gradient difference {worst:.2e}"
    if padded_router is not None:  # a mixture of experts: load balance over the same tokens
        assert other_router == pytest.approx(padded_router, rel=1e-5)


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("name", VL_FAMILIES)
def test_packed_logprobs_and_gradients_equal_padded(tiny_family_dir, name: str, case: str) -> None:
    model, processor, prompts = _prompts(tiny_family_dir, name, CASES[case])
    _assert_packed_equals_padded(model, _batch(prompts, seed=len(prompts)), processor.tokenizer.pad_token_id)


@pytest.mark.parametrize("packed", [False, True], ids=["cached", "packed"])
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("name", VL_FAMILIES)
def test_shared_prompt_logprobs_and_gradients_equal_padded(
    tiny_family_dir, name: str, case: str, packed: bool
) -> None:
    """Each prompt run once for its responses, through a cache of its keys and values or packed before
    them in one sequence."""
    model, processor, prompts = _prompts(tiny_family_dir, name, CASES[case])
    batch = _batch(prompts, seed=len(prompts))
    _assert_packed_equals_padded(model, batch, processor.tokenizer.pad_token_id, shared=True, packed=packed)


@pytest.mark.parametrize("packed", [False, True], ids=["cached", "packed"])
@pytest.mark.parametrize("responses", [1, 2])
@pytest.mark.parametrize("name", VL_FAMILIES)
def test_prompts_that_start_alike_share_their_common_text_exactly(
    tiny_family_dir, name, responses, packed
) -> None:
    """Distinct prompts after one system prompt: its tokens run once for the micro-batch (stage 1), then
    each prompt's images and question (stage 2), then the responses (stage 3), at the padded numbers;
    with one response per prompt, stage 1 alone is shared."""
    from mmrl.training.shared_prompt import MIN_COMMON, shared_prompts

    system = "You are a careful visual assistant. Look at every image, then answer in one word."
    model, processor, prompts = _prompts(tiny_family_dir, name, None, system)
    batch = _batch(prompts, seed=3)
    if responses == 1:
        batch = batch.select(range(0, len(batch), 2))
    sharing = shared_prompts(model, family_of(model), batch["prompt_index"].tolist(), batch, router=False)
    assert sharing is not None and sharing.common >= MIN_COMMON
    assert len(sharing.first) == len(prompts) and len(sharing.group) == responses * len(prompts)
    _assert_packed_equals_padded(model, batch, processor.tokenizer.pad_token_id, shared=True, packed=packed)


@pytest.mark.parametrize("include_vision", [False, True], ids=["language", "vision"])
def test_lora_adapters_packed_and_shared_equal_padded(tiny_family_dir, include_vision: bool) -> None:
    """The adapters' log-probs and gradients with each prompt packed once before its responses: those of
    the plain padded forward (adapters on the language model, and on the vision tower too)."""
    from mmrl.config.model import LoraConfig
    from mmrl.training.lora import apply_lora

    model, processor, prompts = _prompts(tiny_family_dir, "qwen2_5_vl", CASES["mixed"])
    apply_lora(model, LoraConfig(rank=4, include_vision=include_vision))  # in place, as the trainer uses it
    gen = torch.Generator().manual_seed(0)
    for name, p in model.named_parameters():
        if "lora_B" in name:  # peft starts B at 0, where the adapters would not change the numbers
            p.data = torch.randn(p.shape, generator=gen) * 0.1
    batch = _batch(prompts, seed=2)
    _assert_packed_equals_padded(model, batch, processor.tokenizer.pad_token_id, shared=True, packed=True)


def test_the_switch_reaches_the_actor_reference_and_critic_forwards(tiny_family_dir, monkeypatch) -> None:
    """`actor.padding_free` runs the critic's values, the actor's (and so the reference's) log-probs and
    the update's loss and gradient packed, over several micro-batches, at the padded numbers."""
    _, processor, prompts = _prompts(tiny_family_dir, "qwen2_5_vl", None)
    batch = _batch(prompts, seed=1)
    batch.set(advantages=torch.linspace(-1, 1, len(batch))[:, None].expand(-1, WIDTH).clone())
    pad_id = processor.tokenizer.pad_token_id
    packs: list[int] = []
    monkeypatch.setattr("mmrl.training.forward.pack", lambda *args: packs.append(1) or pack(*args))
    seen = {}
    for padding_free in (False, True):
        policy = load_policy(tiny_family_dir("qwen2_5_vl"))
        critic = Critic(ValueModel(policy), CriticConfig(), pad_id, WIDTH, 1, 4, padding_free=padding_free)
        torch.nn.init.normal_(critic.model.value_head.weight, generator=torch.Generator().manual_seed(0))
        cfg = ActorConfig(micro_batch_size=4, use_kl_loss=False, padding_free=padding_free)
        actor = Actor(policy, cfg, pad_id, temperature=1.0, response_len=WIDTH, total_updates=1)
        marks = [len(packs)]
        values = critic.values(batch)
        marks.append(len(packs))
        logp = actor.logprobs(batch)
        marks.append(len(packs))
        stats = actor.update(batch, plan_minibatches(batch, len(batch), epochs=1, horizon=WIDTH)).metrics
        marks.append(len(packs))
        assert all((b > a) == padding_free for a, b in pairwise(marks)), marks  # each forward packs
        seen[padding_free] = (values, logp, stats)
    mask = batch["response_mask"].bool()
    for padded, packed in zip(seen[False][:2], seen[True][:2], strict=True):
        assert (packed - padded)[mask].abs().max() < 1e-5
    for key in ("actor/pg_loss", "actor/grad_norm"):
        assert seen[True][2][key] == pytest.approx(seen[False][2][key], rel=1e-5)


def test_packed_text_model_equals_padded(tiny_family_dir) -> None:
    folder = tiny_family_dir("text")
    model, tokenizer = load_policy(folder), tokenizer_of(load_processor(folder))
    questions = ["What is 3 + 4?", "Find x: the side of a square is 5 cm, what is its area?", "How many?"]
    prompts = [
        PromptSample(i, encode_prompt(tokenizer, build_messages(q, 0), []), q, "7")
        for i, q in enumerate(questions)
    ]
    for shared, packed in ((False, True), (True, False), (True, True)):
        _assert_packed_equals_padded(model, _batch(prompts, seed=0), tokenizer.pad_token_id, shared, packed)


def test_packed_positions_restart_per_sequence_and_keep_the_mrope_rows() -> None:
    ids = torch.tensor([[0, 5, 6, 7, 8, 0], [9, 9, 9, 3, 0, 0]])
    attention = (ids != 0).long()
    mrope = torch.arange(36).view(3, 2, 6)
    packed = pack(ids, attention, mrope, prompt_width=3)
    assert packed.input_ids.tolist() == [[5, 6, 7, 8, 9, 9, 9, 3]]
    assert packed.positions[0, 0].tolist() == [0, 1, 2, 3, 0, 1, 2, 3]
    assert torch.equal(packed.positions[1:, 0], mrope[:, attention.bool()])
    assert packed.index.tolist()[0] == [1, 2, 3] and packed.index[1, :2].tolist() == [6, 7]
    assert packed.valid.tolist() == [[True, True, False], [True, False, False]]
    with pytest.raises(ValueError, match="holes"):
        pack(ids, torch.tensor([[0, 1, 1, 1, 0, 1], [1, 1, 1, 1, 0, 0]]), mrope, prompt_width=3)


def test_segment_attention_equals_attention_under_the_dense_mask() -> None:
    """Each segment attends causally to itself and wholly to its context, as under the (N, N) mask it
    replaces; runs of equal segments (a group's equal-length responses, same-size rows) go as one batch."""
    c, p1 = range(0, 3), range(3, 6)
    segments = [
        Segment(0, 3),  # text every prompt starts with
        Segment(3, 6, (c,)),  # a group's prompt
        Segment(6, 9, (c, p1)),  # its responses: two of three tokens (one run), one of two
        Segment(9, 12, (c, p1)),
        Segment(12, 14, (c, p1)),
        Segment(14, 17),  # rows packed whole: two of three tokens (one run), one of one
        Segment(17, 20),
        Segment(20, 21),
    ]
    plan = SegmentPlan(segments, "cpu")
    assert [(r.start, r.count) for r in plan.runs] == [(0, 1), (3, 1), (6, 2), (12, 1), (14, 2), (20, 1)]
    dense = torch.zeros(21, 21, dtype=torch.bool)
    for s in segments:
        own = torch.arange(s.start, s.end)
        dense[own[:, None], own[None]] = torch.ones(len(own), len(own), dtype=torch.bool).tril()
        for context in s.context:
            dense[own[:, None], torch.tensor(list(context))[None]] = True
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, heads, 21, 8, generator=gen) for heads in (4, 2, 2))  # grouped-query heads
    expected = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=dense, enable_gqa=True)
    got = plan.attend(q, k, v, scaling=None, dropout=0.0)
    torch.testing.assert_close(got, expected.transpose(1, 2), rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match="in order"):
        SegmentPlan([Segment(0, 2), Segment(3, 4)], "cpu")


@pytest.mark.parametrize("name", ["qwen3_5", "qwen3_5_moe"])
def test_qwen3_5_refuses_to_pack_since_its_recurrent_state_runs_across_rows(tiny_family_dir, name) -> None:
    """The first packed row is exact; the rows after it start from the previous row's DeltaNet state."""
    model, processor, prompts = _prompts(tiny_family_dir, name, None)
    batch = _batch(prompts, seed=0)
    pad_id = processor.tokenizer.pad_token_id
    with torch.no_grad():
        padded, packed = (forward_logprobs(model, batch, pad_id, padding_free=p)[0] for p in (False, True))
    gap = (packed - padded).abs() * batch["response_mask"]
    assert gap[0].max() < 1e-5 and gap[1:].max() > 1e-4
    assert not family_of(model).packs_sequences
    cfg = Config.model_validate(
        {"model": {"path": "tiny"}, "data": {"train_files": ["rows.jsonl"]}, "actor": {"padding_free": True}}
    )
    with pytest.raises(ConfigError, match=r"actor\.padding_free"):
        build_actor(cfg, model, pad_id, torch.float32)


def test_packing_under_gradient_checkpointing_on_a_cpu_says_it_is_slower(tiny_model_dir, caplog) -> None:
    """Under gradient checkpointing packed rows keep to transformers' dense mask, which on a CPU costs
    more than the padding saved: the run says so once, at start, and still packs. Without checkpointing
    (mmrl's per-sequence attention) it says nothing."""
    model = load_policy(tiny_model_dir)
    pad_id = tokenizer_of(load_processor(tiny_model_dir)).pad_token_id
    settings = {
        "model": {"path": "tiny"},
        "data": {"train_files": ["rows.jsonl"]},
        "actor": {"padding_free": True},
    }
    with caplog.at_level("WARNING", logger="mmrl.training.actor"):
        build_actor(Config.model_validate(settings), model, pad_id, torch.float32)
        assert not caplog.records
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        actor = build_actor(Config.model_validate(settings), model, pad_id, torch.float32)
    assert actor.cfg.padding_free
    assert [r.getMessage() for r in caplog.records if "dense mask" in r.getMessage()], caplog.text


@pytest.mark.parametrize("name", ["qwen2_5_vl", "qwen3_5"])
def test_auto_packs_only_where_it_pays(tiny_family_dir, name: str) -> None:
    """`actor.padding_free: auto` (the default) packs a model at least `PACKS_FROM_WIDTH` wide, not the tiny
    test models (where packing is slower and every learning test's numbers were measured padded), not under
    gradient checkpointing, and never a family that cannot pack; `true` and `false` are kept as set."""
    model = load_policy(tiny_family_dir(name))
    text = family_of(model).text_config
    packs = family_of(model).packs_sequences
    assert ActorConfig().padding_free == "auto"
    assert text.hidden_size < PACKS_FROM_WIDTH and not runs_packed("auto", model)
    assert runs_packed(True, model) and not runs_packed(False, model)
    text.hidden_size = PACKS_FROM_WIDTH  # the rule reads the width from the config alone
    assert runs_packed("auto", model) == packs
    # the actor (and with it the reference) and the critic resolve the default for their own model
    actor = Actor(model, ActorConfig(), 0, temperature=1.0, response_len=8, total_updates=1)
    critic = Critic(ValueModel(model), CriticConfig(), 0, 8, 1, 4, padding_free="auto")
    assert actor.padding_free == critic.padding_free == packs
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    assert not runs_packed("auto", model)


def test_the_shared_prompt_steps_aside_where_it_would_not_be_exact(tiny_family_dir) -> None:
    """The padded forward runs instead where sharing would change the numbers or gain nothing: Qwen3.5's
    recurrent layers, a response holding a video, an MoE router loss (it would count
    the prompt once, not per response), and rows whose prompts all differ."""
    from mmrl.training.shared_prompt import shared_prompts

    model, _, prompts = _prompts(tiny_family_dir, "qwen2_5_vl", ["image", "text"])
    family = family_of(model)
    batch = _batch(prompts, seed=0)
    rows = batch["prompt_index"].tolist()
    assert shared_prompts(model, family, rows, batch, router=False)
    assert not shared_prompts(model, family, rows, batch, router=True)
    one_each = batch.select([0, 2])  # one response of each prompt
    assert not shared_prompts(model, family, one_each["prompt_index"].tolist(), one_each, router=False)
    with_video = batch["response_ids"].clone()
    with_video[0, 0] = family.media_token_ids()["video"]
    video_batch = Batch(tensors={**batch.tensors, "response_ids": with_video}, prompts=batch.prompts)
    assert not shared_prompts(model, family, rows, video_batch, router=False)
    qwen3_5, _, _ = _prompts(tiny_family_dir, "qwen3_5", ["text"])
    assert not shared_prompts(qwen3_5, family_of(qwen3_5), rows, batch, router=False)
