"""Multi-turn agents (`mmrl.agent`): tool-call parsing, the built-in tools, failures counted and survived,
trajectory limits, and the trainer's log-probs over a multi-turn trajectory with images in two turns."""

from __future__ import annotations

import logging
import textwrap
from dataclasses import replace
from pathlib import Path
from typing import Any
from unittest import mock

import numpy as np
import pytest
import torch
from helpers import ZOOM_CALL, Forced, ForcedScript, assert_scored_like_sampled, zoom_prompts
from PIL import Image

from mmrl.agent import (
    AgentEngine,
    AgentLimits,
    CallError,
    SeenImage,
    ToolBox,
    ToolCall,
    ToolError,
    ToolResponder,
    ToolSpec,
    calculator,
    check_arguments,
    image_zoom,
    parse_tool_calls,
)
from mmrl.agent.scripts import SCRIPT, Script, ScriptedEngine
from mmrl.errors import ConfigError


# ---------------------------------------------------------------- parsing
@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (ZOOM_CALL, [ToolCall("image_zoom", {"bbox_2d": [56, 0, 112, 56]})]),
        ('<tool_call>{"name": "calc", "arguments": {"x": 1}}', [ToolCall("calc", {"x": 1})]),  # no close tag
        (
            '<tool_call>\n```json\n{"name": "calc", "arguments": {}}\n```\n</tool_call>',
            [ToolCall("calc", {})],
        ),
        (
            "<tool_call>{'name': 'calc', 'arguments': {'x': True}}</tool_call>",
            [ToolCall("calc", {"x": True})],
        ),
        (
            '<tool_call>{"name": "calc", "arguments": "{\\"x\\": 2}"}</tool_call>',
            [ToolCall("calc", {"x": 2})],
        ),
        ('<tool_call>{"name": "calc", "parameters": {"x": 3}}</tool_call>', [ToolCall("calc", {"x": 3})]),
        ("<answer>red</answer>", []),
    ],
)
def test_tool_calls_are_read_tolerantly(text: str, expected: list[ToolCall]) -> None:
    assert parse_tool_calls(text) == expected


def test_unreadable_calls_become_errors_in_order() -> None:
    text = '<tool_call>{"name": calc</tool_call> then <tool_call>{"arguments": {}}</tool_call>' + ZOOM_CALL
    first, second, third = parse_tool_calls(text)
    assert isinstance(first, CallError) and "not a JSON object" in first.detail
    assert isinstance(second, CallError) and "name" in second.detail
    assert third == ToolCall("image_zoom", {"bbox_2d": [56, 0, 112, 56]})


def test_a_pathological_call_is_an_error_not_an_exception() -> None:
    (deep,) = parse_tool_calls("<tool_call>" + "[" * 5000)
    assert isinstance(deep, CallError)


def test_tools_are_described_even_by_a_template_that_ignores_them() -> None:
    """Some checkpoints' chat templates have no tools block: the tools then go into the system turn."""
    from mmrl.models.tiny import build_tokenizer
    from mmrl.processors import build_messages, encode_prompt

    tokenizer = build_tokenizer()
    tokenizer.chat_template = tokenizer.chat_template.replace("{% if tools %}", "{% if false %}", 1)
    tools = [ToolSpec.from_config({"function": "calculator"}).schema()]
    text = tokenizer.decode(
        encode_prompt(tokenizer, build_messages("2 + 2?", 0, "Be brief."), [], tools=tools)
    )
    assert text.startswith("<|im_start|>system\nBe brief.\n\n# Tools") and '"name": "calculator"' in text
    assert text.count("<|im_start|>system") == 1 and text.endswith(
        "2 + 2?<|im_end|>\n<|im_start|>assistant\n"
    )


def test_arguments_are_checked_against_the_schema() -> None:
    schema = ToolSpec.from_config({"function": "image_zoom"}).parameters
    assert check_arguments(schema, {"bbox_2d": [0, 0, 1, 1]}) is None
    assert "missing" in check_arguments(schema, {})
    assert "expected 4 to 4 items" in check_arguments(schema, {"bbox_2d": [0, 0, 1]})
    assert "expected number" in check_arguments(schema, {"bbox_2d": [0, 0, 1, True]})
    assert "expected integer" in check_arguments(schema, {"bbox_2d": [0, 0, 1, 1], "image_index": 0.5})
    closed = {"type": "object", "properties": {"a": {"enum": ["x"]}}, "additionalProperties": False}
    assert "unknown argument" in check_arguments(closed, {"b": 1})
    assert "one of" in check_arguments(closed, {"a": "y"})


# ---------------------------------------------------------------- built-in tools
def test_calculator_evaluates_arithmetic_and_refuses_anything_else() -> None:
    assert calculator("(3 + 4) * 2") == "14"
    assert calculator("2^10") == "1024"
    assert calculator("sqrt(2) * sqrt(2)") == "2"
    assert calculator("7 / 2") == "3.5"
    # Built-ins run in the trainer's process: inputs that would compute for minutes are refused at once.
    slow = ("9 ** 9 ** 9", "((9 ** 999) ** 999) ** 999", "round(1, -10 ** 9)", "3 ** 2000 * 3 ** 2000")
    for bad in ("__import__('os')", "1 / 0", "x + 1", "(1).__class__", *slow):
        with pytest.raises(ToolError):
            calculator(bad)


def test_image_zoom_crops_the_original_in_the_coordinates_the_model_saw() -> None:
    original = Image.fromarray(
        np.arange(448 * 448 * 3, dtype=np.uint32).reshape(448, 448, 3).astype(np.uint8)
    )
    seen = [SeenImage(original, (112, 112))]
    crop = image_zoom([56, 0, 112, 56], seen)
    assert crop.size == (224, 224)
    assert np.array_equal(np.asarray(crop), np.asarray(original)[0:224, 224:448])
    thousandths = image_zoom([500, 0, 1000, 500], seen, frame="norm1000")
    assert np.array_equal(np.asarray(thousandths), np.asarray(crop))
    swapped = image_zoom([112, 56, 56, 0], seen)  # the same two corners, the other way round
    assert np.array_equal(np.asarray(swapped), np.asarray(crop))
    with pytest.raises(ToolError, match="holds no pixels"):
        image_zoom([50, 50, 50, 60], seen)
    with pytest.raises(ToolError, match="image_index 1"):
        image_zoom([0, 0, 10, 10], seen, image_index=1)


# ---------------------------------------------------------------- failures
def _user_tools(tmp_path: Path) -> list[ToolSpec]:
    file = tmp_path / "tools.py"
    file.write_text(
        textwrap.dedent(
            """
            import os, time

            def lookup(city):
                return {"paris": "sunny"}[city]   # KeyError for any other city

            def hang(seconds):
                time.sleep(seconds)
                return "woke"

            def die():
                os._exit(3)

            def odd():
                return {"not": "text"}
            """
        )
    )
    schema = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    empty = {"type": "object", "properties": {}}
    specs = [
        {"function": f"{file}:lookup", "parameters": schema},
        {
            "function": f"{file}:hang",
            "parameters": {"type": "object", "properties": {"seconds": {"type": "number"}}},
        },
        {"function": f"{file}:die", "parameters": empty},
        {"function": f"{file}:odd", "parameters": empty},
        {"function": "calculator"},
    ]
    return [ToolSpec.from_config(s) for s in specs]


def test_every_failure_kind_is_counted_and_answered_and_the_tools_keep_working(tmp_path: Path) -> None:
    """A malformed call, an unknown tool, bad arguments (schema and the tool's own refusal), an exception,
    a hang past the timeout, a dead worker and a result that is not text: each one is an error observation,
    counted per tool and kind, and the next calls still run."""
    box = ToolBox(_user_tools(tmp_path), timeout_s=2.0, num_workers=1)
    try:
        calls = [
            CallError("the tool call is not a JSON object"),
            ToolCall("weather", {}),
            ToolCall("lookup", {"city": 3}),
            ToolCall("calculator", {"expression": "1 / 0"}),
            ToolCall("lookup", {"city": "rome"}),
            ToolCall("hang", {"seconds": 60}),
            ToolCall("die", {}),
            ToolCall("odd", {}),
            ToolCall("lookup", {"city": "paris"}),
            ToolCall("calculator", {"expression": "6 * 7"}),
        ]
        out = box.run(calls, [[] for _ in calls])
        assert [o.failure for o in out] == [
            "malformed",
            "unknown_tool",
            "bad_arguments",
            "bad_arguments",
            "exception",
            "timeout",
            "exception",
            "exception",
            None,
            None,
        ]
        assert out[1].parts[0].startswith("Error: there is no tool 'weather'")
        assert "KeyError" in out[4].parts[0]
        assert out[8].parts == ["sunny"] and out[9].parts == ["42"]
        assert box.failures == {
            "call/malformed": 1,
            "weather/unknown_tool": 1,
            "lookup/bad_arguments": 1,
            "calculator/bad_arguments": 1,
            "lookup/exception": 1,
            "hang/timeout": 1,
            "die/exception": 1,
            "odd/exception": 1,
        }
        again = box.run([ToolCall("lookup", {"city": "paris"})], [[]])  # after a kill and a death
        assert again[0].parts == ["sunny"]
    finally:
        box.close()


def test_a_broken_tool_file_fails_at_start_in_one_line(tmp_path: Path) -> None:
    file = tmp_path / "bad.py"
    file.write_text("def f(:\n")
    with pytest.raises(ImportError, match="syntax error"):
        ToolBox([ToolSpec.from_config({"function": f"{file}:f", "parameters": {"type": "object"}})])
    with pytest.raises(ValueError, match="built-ins are image_zoom, calculator"):
        ToolSpec.from_config({"function": "zoom"})


def test_a_tool_option_of_an_unknown_value_and_two_tools_of_one_name_are_refused_at_start(
    tmp_path: Path,
) -> None:
    """`frame: norm100` once cropped as norm1000 without a word, and a second `lookup` replaced the first."""
    with pytest.raises(
        ConfigError, match=r"frame: 'norm100' is not one of model_input, norm1000\. Did you mean norm1000\?"
    ):
        ToolSpec.from_config({"function": "image_zoom", "kwargs": {"frame": "norm100"}})
    with pytest.raises(
        ConfigError, match=r"unknown kwargs key 'frames'; its keys: frame\. Did you mean frame\?"
    ):
        ToolSpec.from_config({"function": "image_zoom", "kwargs": {"frames": "norm1000"}})
    assert ToolSpec.from_config({"function": "image_zoom", "kwargs": {"frame": "norm1000"}}).kwargs
    schema = {"type": "object"}
    a, b = tmp_path / "a.py", tmp_path / "b.py"
    specs = [ToolSpec.from_config({"function": f"{f}:lookup", "parameters": schema}) for f in (a, b)]
    with pytest.raises(ConfigError, match=rf"two tools are named 'lookup' \({a}:lookup and {b}:lookup\)"):
        ToolBox(specs)


# ---------------------------------------------------------------- trajectories
@pytest.fixture(scope="module")
def tiny(tiny_model_dir: Path) -> Any:
    from mmrl.models import load_policy, load_processor

    return load_policy(tiny_model_dir), load_processor(tiny_model_dir)


def _prompts(tiny: Any, count: int) -> list[Any]:
    model, processor = tiny
    return zoom_prompts(processor, _budget(model), count, {"function": "image_zoom"})


def _budget(model: Any) -> Any:
    from mmrl.models import family_of
    from mmrl.processors import PixelBudget

    grid = family_of(model).grid()
    return PixelBudget(112 * 112, 112 * 112, grid.patch, grid.merge, family_of(model).image_size_rule)


def _agent(tiny: Any, engine: Any, limits: AgentLimits | None = None) -> AgentEngine:
    model, processor = tiny
    box = ToolBox([ToolSpec.from_config({"function": "image_zoom"})])
    return AgentEngine(
        engine,
        ToolResponder(box),
        processor.tokenizer,
        processor.image_processor,
        _budget(model),
        limits or AgentLimits(),
    )


def _scripted(prompts: list[Any], turns: list[str]) -> list[Any]:
    return [replace(p, extra={SCRIPT: Script(list(turns))}) for p in prompts]


def test_a_trajectory_interleaves_policy_turns_and_tool_responses_with_their_images(tiny: Any) -> None:
    _, processor = tiny
    agent = _agent(tiny, ScriptedEngine(processor.tokenizer))
    prompts = _prompts(tiny, 2)
    batch = agent.generate(_scripted(prompts, [ZOOM_CALL, "<answer>red</answer>"]), _params())
    assert len(batch) == 2 and batch["group_index"].tolist() == [0, 1]
    assert batch["turns"].tolist() == [2] * 2 and batch["tool_calls"].tolist() == [1] * 2
    assert batch["tool_calls_ok"].tolist() == [1] * 2
    assert not batch["truncated"].any() and batch["response_text"] == ["<answer>red</answer>"] * 2
    row = batch.prompts[0]
    assert len(row.images) == 2 and row.image_grid_thw.shape == (2, 3)  # the prompt's and the zoom's
    assert row.prompt_ids == prompts[0].prompt_ids  # the first prompt; the rest is the response
    ids, policy, attention = (
        batch["response_ids"][0],
        batch["response_mask"][0],
        batch["response_attention"][0],
    )
    text = processor.tokenizer.decode(ids[attention.bool()])
    assert text.startswith(ZOOM_CALL) and text.endswith("<answer>red</answer><|im_end|>")
    observation = processor.tokenizer.decode(ids[attention.bool() & ~policy.bool()])
    assert observation.startswith("\n<|im_start|>user\n<tool_response>\n<|vision_start|><|image_pad|>")
    assert observation.endswith("</tool_response><|im_end|>\n<|im_start|>assistant\n")
    assert row.extra["agent_ending"] == "answer" and [t["role"] for t in row.extra["agent_turns"]] == [
        "assistant",
        "tool",
        "assistant",
    ]
    zoomed = row.extra["agent_turns"][1]["images"][0]
    assert zoomed.size == (112, 112)  # the 224-px quadrant sized within the budget


def _params(n: int = 1, logprobs: bool = False) -> Any:
    from mmrl.rollout import SamplingParams

    return SamplingParams(n=n, max_new_tokens=80, logprobs=logprobs)


@pytest.mark.parametrize("ending", ["max_turns", "max_images", "max_tokens"])
def test_a_trajectory_over_a_limit_ends_truncated_and_counted(tiny: Any, ending: str) -> None:
    _, processor = tiny
    prompts = _prompts(tiny, 1)
    call = len(processor.tokenizer(ZOOM_CALL)["input_ids"]) + 1
    limits = {
        "max_turns": AgentLimits(max_turns=1),  # the turn's call is never answered
        "max_images": AgentLimits(max_images=1),  # the zoom would be a second image
        "max_tokens": AgentLimits(max_tokens=len(prompts[0].prompt_ids) + call + 8),  # no room for the reply
    }[ending]
    agent = _agent(tiny, ScriptedEngine(processor.tokenizer), limits)
    batch = agent.generate(_scripted(prompts, [ZOOM_CALL, "<answer>red</answer>"]), _params())
    assert bool(batch["truncated"][0]) and batch.prompts[0].extra["agent_ending"] == ending
    attention = batch["response_attention"][0].bool()
    assert len(prompts[0].prompt_ids) + int(attention.sum()) <= limits.max_tokens
    last = int(attention.nonzero().max())
    assert bool(batch["response_mask"][0][last]), "a trajectory never ends on a tool response"


def test_trainer_logprobs_over_a_multi_turn_trajectory_equal_the_engines_and_tool_tokens_get_no_gradient(
    tiny: Any,
) -> None:
    """One forward over the whole trajectory (two images, one returned by the tool mid-conversation)
    gives every policy token the log-prob the HF engine sampled it with, turn by turn; the loss on it
    sends exactly zero gradient to the tool response's positions."""
    from mmrl.rollout import HFEngine

    model, processor = tiny
    engine = HFEngine(Forced(model), processor)
    agent = _agent(tiny, ForcedScript(engine, processor.tokenizer))
    prompts = _scripted(_prompts(tiny, 2), [ZOOM_CALL, "<answer>red</answer>"])
    batch = agent.generate(prompts, replace(_params(logprobs=True), temperature=1.0))
    assert batch["tool_calls"].tolist() == [1, 1] and len(batch.prompts[0].images) == 2
    assert_scored_like_sampled(model, batch, processor.tokenizer.pad_token_id)


def test_the_example_user_tools_run_in_workers_with_the_trajectorys_images() -> None:
    """examples/agent_tools: a text result from a box of the original image, and an image result."""
    root = Path(__file__).resolve().parent.parent / "examples" / "agent_tools" / "tools.py"
    box_schema = {"type": "object", "properties": {"bbox_2d": {"type": "array"}}, "required": ["bbox_2d"]}
    specs = [
        ToolSpec.from_config({"function": f"{root}:region_colour", "parameters": box_schema}),
        ToolSpec.from_config({"function": f"{root}:high_contrast", "parameters": {"type": "object"}}),
    ]
    original = Image.new("RGB", (448, 448), (10, 20, 30))
    original.paste((200, 100, 0), (224, 0, 448, 224))
    seen = [SeenImage(original, (112, 112))]
    tools = ToolBox(specs, timeout_s=30.0, num_workers=1)
    try:
        colour, contrast = tools.run(
            [ToolCall("region_colour", {"bbox_2d": [56, 0, 112, 56]}), ToolCall("high_contrast", {})],
            [seen, seen],
        )
    finally:
        tools.close()
    assert colour.parts == ["mean colour: red 200, green 100, blue 0"] and colour.failure is None
    (image,) = contrast.parts
    assert isinstance(image, Image.Image) and image.size == (448, 448)


def test_the_agent_graders_read_the_turns() -> None:
    """zoom_hit: a zoom that happened, whose box holds the target's centre and is tight enough to enlarge
    it (a box around every place a target can be is no hit); answer_with_tool: right, and after a call."""
    from mmrl.rewards import RewardInput
    from mmrl.rewards.graders import GRADERS

    crop = Image.new("RGB", (8, 8))

    def zoom(box: str, shown: tuple[Image.Image, ...] = (crop,)) -> list[dict[str, Any]]:
        call = ZOOM_CALL.replace("[56, 0, 112, 56]", box)
        return [
            {"role": "assistant", "text": call, "images": []},
            {"role": "tool", "text": "", "images": list(shown)},
        ]

    tight = "[96, 26, 76, 6]"
    turns = zoom(tight)  # 20 x 20 around the 12 x 12 target, its corners the other way round
    extra = {
        "agent_turns": turns,
        "agent_tool_calls": 1,
        "agent_tool_calls_ok": 1,
        "target_box": [80, 10, 92, 22],
    }
    hit = RewardInput("<answer>red</answer>", ground_truth="red", extra=extra)
    assert GRADERS["zoom_hit"](hit) == 1.0 and GRADERS["answer_with_tool"](hit) == 1.0
    miss = RewardInput(
        "<answer>red</answer>", ground_truth="red", extra={**extra, "target_box": [10, 80, 22, 92]}
    )
    assert GRADERS["zoom_hit"](miss) == 0.0
    for wide in ("[56, 0, 112, 56]", "[0, 0, 112, 112]"):  # holds the target, but 22x its area and more
        assert GRADERS["zoom_hit"](RewardInput("", extra={**extra, "agent_turns": zoom(wide)})) == 0.0
    for turns in (zoom(tight, shown=()), zoom(tight)[:1]):  # the tool answered with an error, or never
        assert GRADERS["zoom_hit"](RewardInput("", extra={**extra, "agent_turns": turns})) == 0.0
    wrong = RewardInput("<answer>blue</answer>", ground_truth="red", extra=extra)
    assert GRADERS["answer_with_tool"](wrong) == 0.0
    malformed = RewardInput(
        "<answer>red</answer>", ground_truth="red", extra={**extra, "agent_tool_calls_ok": 0}
    )
    assert GRADERS["answer_with_tool"](malformed) == 0.0, "only a call that returned a result counts"
    with pytest.raises(ValueError, match="target box"):
        GRADERS["zoom_hit"](RewardInput("x"))


def test_a_groups_trajectories_share_their_first_prompts_forward_exactly(tiny: Any) -> None:
    """Two prompts, three trajectories each, zooming onto different boxes (so each response holds its own
    tool image) and answering differently: the shared-prompt forward runs the tool preamble both prompts
    start with once, each first prompt once, and gives the padded forward's log-probs and gradients
    (`mmrl.training.shared_prompt`), through a cache or packed in one sequence (`actor.padding_free`)."""
    from mmrl.models import family_of
    from mmrl.rollout import HFEngine
    from mmrl.training import forward
    from mmrl.training.shared_prompt import MIN_COMMON, shared_prompts

    model, processor = tiny
    agent = _agent(tiny, ForcedScript(HFEngine(Forced(model), processor), processor.tokenizer))
    boxes = ["[56, 0, 112, 56]", "[0, 0, 56, 56]", "[0, 56, 112, 112]"]
    answers = ["red", "blue", "a green one"]
    scripts = [
        _scripted([prompt], [ZOOM_CALL.replace("[56, 0, 112, 56]", box), f"<answer>{answer}</answer>"])[0]
        for prompt in _prompts(tiny, 2)
        for box, answer in zip(boxes, answers, strict=True)
    ]
    batch = agent.generate(scripts, _params(logprobs=True))
    batch.set(group_index=torch.tensor([0, 0, 0, 1, 1, 1]))  # two prompts, three trajectories each
    assert batch["tool_calls"].tolist() == [1] * 6 and all(len(p.images) == 2 for p in batch.prompts)
    sharing = shared_prompts(model, family_of(model), batch["prompt_index"].tolist(), batch, router=False)
    assert sharing is not None and sharing.common >= MIN_COMMON and sharing.group == [0, 0, 0, 1, 1, 1]
    pad_id = processor.tokenizer.pad_token_id

    def run(shared: bool, packed: bool = False) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        model.zero_grad(set_to_none=True)
        target = "packed_media" if packed else "shared_prompt_hidden"
        spy = mock.patch.object(forward, target, wraps=getattr(forward, target))
        plain = mock.patch.object(forward, "shared_prompts", return_value=None)
        with spy if shared else plain as watched:
            logp, _ = forward.forward_logprobs(model, batch, pad_id, padding_free=packed)
        assert watched.called
        (logp * batch["response_mask"]).sum().backward()
        return logp.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    padded, padded_grads = run(False)
    mask = batch["response_mask"].bool()
    for shared, shared_grads in (run(True), run(True, packed=True)):  # through a cache, or packed
        assert (shared - padded)[mask].abs().max() < 1e-5
        assert padded_grads.keys() == shared_grads.keys()
        for name, grad in padded_grads.items():
            assert (shared_grads[name] - grad).norm() <= 1e-5 * grad.norm().clamp(min=1e-12), name


def test_the_first_failure_of_each_tool_and_kind_is_printed_with_its_message(caplog) -> None:
    """A tool failing on every call shows up as a line with the error, once per tool and kind, not only as
    a count in metrics.jsonl."""
    box = ToolBox([ToolSpec.from_config({"function": "calculator"})])
    calls = [ToolCall("calculator", {"expression": f"{n} / 0"}) for n in range(3)] + [
        ToolCall("weather", {})
    ] * 2
    with caplog.at_level(logging.WARNING, logger="mmrl.agent.tools"):
        box.run(calls, [[] for _ in calls])
    assert box.failures == {"calculator/bad_arguments": 3, "weather/unknown_tool": 2}
    lines = [r.getMessage() for r in caplog.records if r.name == "mmrl.agent.tools"]
    assert len(lines) == 2, lines
    assert "'calculator' failed (bad_arguments)" in lines[0] and "division by zero" in lines[0]
    assert "'weather' failed (unknown_tool)" in lines[1] and "there is no tool 'weather'" in lines[1]
