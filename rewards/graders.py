"""Built-in graders, registered by short name so a config can say `answer_match` instead of a file path.

Graders are trusted and cheap (string work only), which is why the reward manager runs them in-process even
when user functions are isolated in worker processes.
"""

from __future__ import annotations

import importlib.util
import re
import sys
from collections.abc import Callable
from types import ModuleType
from typing import TypeVar

from mmrl.rewards.types import RewardFn, RewardInput

GRADERS: dict[str, RewardFn] = {}
BATCHED_GRADERS: set[str] = set()

_F = TypeVar("_F", bound=RewardFn)

_BOXED = re.compile(r"\\boxed\s*\{")
# A brace, or an escaped character (`\\{` is a literal brace in LaTeX, not a group).
_BRACE = re.compile(r"\\.|[{}]", re.DOTALL)
_ANSWER_LINE = re.compile(r"\banswer\s*(?:is\b\s*:?|:)([^\n]*)", re.IGNORECASE)
_TAGGED = re.compile(r"\s*(?:<think>.*?</think>\s*)?<answer>(.*?)</answer>\s*", re.DOTALL)
# What may follow a box in a well-formed response: closing math delimiters and a full stop belong to
# writing the box ("$\boxed{4}$."), anything else is text after the answer.
_BOX_TAIL = re.compile(r"(?:\s|\$|\\\]|\\\)|\.)*")
# Stripped from both ends of an answer: formatting, not content.
_WRAPPERS = " \t\r\n\f\v'\"`$‘’“”"
# Stripped from the end only: sentence punctuation. A leading "." or "-" can be part of a number.
_TRAILING = ".,;:!?"


def register_grader(name: str, batched: bool = False) -> Callable[[_F], _F]:
    """Register a grader under `name`; duplicates are refused so one grader can never silently shadow
    another. A `batched` grader takes the whole `list[RewardInput]` and returns one score per sample
    (model-based rewards, which run one forward pass per batch)."""
    if not name.isidentifier():
        raise ValueError(f"grader name {name!r} must be a Python identifier (it is used in configs and logs)")

    def decorate(fn: _F) -> _F:
        if name in GRADERS:
            raise ValueError(f"a grader named {name!r} is already registered; pick another name")
        GRADERS[name] = fn
        if batched:
            BATCHED_GRADERS.add(name)
        return fn

    return decorate


def _boxes(text: str) -> list[tuple[int, int]]:
    """(content start, closing brace) of each complete top-level `\\boxed{...}`; an unclosed box (a
    truncated response) is not an answer. Braces are matched in one pass, so a response full of unclosed
    boxes costs linear time rather than a scan to the end per box."""
    box_starts = {match.end() for match in _BOXED.finditer(text)}
    closed: list[tuple[int, int]] = []
    open_groups: list[int] = []
    for match in _BRACE.finditer(text):
        if match.group() == "{":
            open_groups.append(match.end())
        elif match.group() == "}" and open_groups and (start := open_groups.pop()) in box_starts:
            closed.append((start, match.start()))
    spans: list[tuple[int, int]] = []
    for start, close in sorted(closed):
        if not spans or start > spans[-1][1]:
            spans.append((start, close))
    return spans


def _last_tagged(text: str) -> str | None:
    """Content of the last `<answer>...</answer>` block, each block ending at the first closing tag after
    it opens. Found with `str.find` in one pass: a regex would rescan to the end from every unclosed tag."""
    answer = None
    pos = 0
    while (start := text.find("<answer>", pos)) >= 0 and (end := text.find("</answer>", start)) >= 0:
        answer = text[start + len("<answer>") : end]
        pos = end + len("</answer>")
    return answer


def extract_answer(text: str, bare_max_chars: int = 0) -> str | None:
    """The final answer in a response: the last `\\boxed{}`, else the last `<answer>` block, else the rest
    of the line after the last "Answer:" or "answer is". With `bare_max_chars`, a one-line response at most
    that long is itself the answer (a model that replied just "B" or "12 cm"). Returns None when there is
    none; never raises, because it runs on arbitrary model output."""
    if not isinstance(text, str):
        return None
    if boxes := _boxes(text):
        start, close = boxes[-1]
        return text[start:close].strip()
    if (tagged := _last_tagged(text)) is not None:
        return tagged.strip()
    if lines := _ANSWER_LINE.findall(text):
        return lines[-1].strip() or None
    bare = text.strip()
    if bare and len(bare) <= bare_max_chars and "\n" not in bare:
        return bare
    return None


def normalize_answer(text: str) -> str:
    """Fold away differences that do not change an answer: case, surrounding whitespace, quotes, `$`,
    trailing sentence punctuation, and runs of inner whitespace."""
    previous = None
    while previous != text:
        previous = text
        text = text.strip(_WRAPPERS).rstrip(_TRAILING)
    return " ".join(text.casefold().split())


@register_grader("answer_match")
def answer_match(sample: RewardInput) -> float:
    """1.0 if the extracted answer equals the ground truth (a string or a list of acceptable strings)
    after normalisation, else 0.0."""
    answer = extract_answer(sample.response)
    if not answer:
        return 0.0
    answer = normalize_answer(answer)
    truth = sample.ground_truth
    accepted = truth if isinstance(truth, (list, tuple)) else [truth]
    return float(any(normalize_answer(str(item)) == answer for item in accepted if item is not None))


@register_grader("answer_with_tool")
def answer_with_tool(sample: RewardInput) -> float:
    """1.0 for a correct answer reached after a tool call that returned a result (an agent run's
    `extra["agent_tool_calls_ok"]`), else 0.0: DeepEyes' conditional tool reward. Added to the accuracy
    reward, it keeps a policy from dropping a tool before the tool has paid off; it never pays for a call
    that led to a wrong answer, nor for a malformed one (a tiny policy learned to write
    `<tool_call><answer>red</answer>` for the bonus when any call counted)."""
    return answer_match(sample) * float(sample.extra.get("agent_tool_calls_ok", 0) > 0)


def _game_outcome(sample: RewardInput, key: str) -> float:
    if key not in sample.extra:
        raise ValueError(
            f"{key} grades games (`agent.game`): the row's trajectory carries no episode outcome; use it "
            "only in runs that play an env turn by turn"
        )
    return float(sample.extra[key])


@register_grader("env_success")
def env_success(sample: RewardInput) -> float:
    """1.0 if the game's episode succeeded (`mmrl.agent.game`), else 0.0."""
    return _game_outcome(sample, "env_success")


@register_grader("env_return")
def env_return(sample: RewardInput) -> float:
    """The game's episode return: the env's rewards summed over its moves (`mmrl.agent.game`)."""
    return _game_outcome(sample, "env_return")


@register_grader("format_answer")
def format_answer(sample: RewardInput) -> float:
    """1.0 for a well-formed response, else 0.0.

    With `<answer>` tags: an optional `<think>` block, then exactly one non-empty `<answer>` block, then
    only whitespace. Without tags: exactly one non-empty `\\boxed{}`, followed only by whitespace, closing
    math delimiters or a full stop.
    """
    text = sample.response
    if "<answer>" in text or "</answer>" in text:
        match = _TAGGED.fullmatch(text)
        one_answer = text.count("<answer>") == text.count("</answer>") == 1
        at_most_one_think = text.count("<think>") == text.count("</think>") <= 1
        return float(bool(match and one_answer and at_most_one_think and match.group(1).strip()))
    boxes = _boxes(text)
    if len(boxes) != 1:
        return 0.0
    start, close = boxes[0]
    return float(bool(text[start:close].strip() and _BOX_TAIL.fullmatch(text, close + 1)))


@register_grader("format_think_boxed")
def format_think_boxed(sample: RewardInput) -> float:
    """1.0 if the response opens with one `<think>...</think>` block and a `\\boxed{}` follows it, else 0.0:
    the reasoning-then-boxed-answer format of math RL recipes."""
    text = sample.response.lstrip()
    if not text.startswith("<think>") or text.count("<think>") != 1 or text.count("</think>") != 1:
        return 0.0
    return float(bool(_boxes(text[text.index("</think>") :])))


def lazy_import(name: str) -> ModuleType:
    """Module `name`, imported on its first attribute access (`importlib.util.LazyLoader`): a grader's
    heavy dependency then costs nothing to processes that never grade with it."""
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.find_spec(name)
    if spec is None or spec.loader is None:
        raise ImportError(f"{name} is not installed; install mmrl's requirements")
    spec.loader = importlib.util.LazyLoader(spec.loader)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module
