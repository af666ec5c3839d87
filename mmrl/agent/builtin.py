"""The built-in tools: `image_zoom` (DeepEyes' "thinking with images") and a safe `calculator`.

A tool is a plain function: its JSON arguments as keyword arguments, plus `images` (every image the
trajectory has shown so far, `SeenImage`) when it declares that parameter. It returns text, an image,
or a list of both, and raises `ToolError` for input it cannot use; the message goes back to the model.
"""

from __future__ import annotations

import ast
import difflib
import math
import operator
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from PIL import Image

from mmrl.errors import ConfigError


class ToolError(ValueError):
    """A tool's refusal of its arguments, shown to the model as the call's result."""


@dataclass(frozen=True)
class SeenImage:
    """An image of the trajectory: the full-resolution original and its (width, height) as the model
    saw it, so a box in the model's coordinates maps back onto the original."""

    original: Image.Image
    model_size: tuple[int, int]


# Units of a box's coordinates: the pixels of the image as the model saw it (Qwen2- and Qwen2.5-VL),
# or thousandths of its width and height (Qwen3-VL).
BOX_FRAMES = ("model_input", "norm1000")


def image_zoom(
    bbox_2d: Sequence[float], images: Sequence[SeenImage], image_index: int = 0, frame: str = "model_input"
) -> Image.Image:
    """Crop the box `bbox_2d` = [x1, y1, x2, y2] (two opposite corners, in either order: a policy that
    writes [x2, y2, x1, y1] meant the same box) of image `image_index` from the full-resolution original;
    the agent loop then sizes the crop within the model's pixel budget, so small detail becomes legible."""
    if not 0 <= image_index < len(images):
        raise ToolError(f"image_index {image_index}: there are {len(images)} images (0 to {len(images) - 1})")
    seen = images[image_index]
    width, height = seen.model_size if frame == "model_input" else (1000, 1000)
    sx, sy = seen.original.width / width, seen.original.height / height
    x1, y1, x2, y2 = (float(v) for v in bbox_2d)
    (x1, x2), (y1, y2) = sorted((x1, x2)), sorted((y1, y2))  # any two opposite corners, in either order
    left, top = max(0, math.floor(x1 * sx)), max(0, math.floor(y1 * sy))
    right, bottom = (
        min(seen.original.width, math.ceil(x2 * sx)),
        min(seen.original.height, math.ceil(y2 * sy)),
    )
    if right - left < 1 or bottom - top < 1:
        raise ToolError(
            f"bbox_2d {list(bbox_2d)} holds no pixels of image {image_index}, which is {width}x{height} "
            "in your coordinates; give two opposite corners [x1, y1, x2, y2] of a box inside the image"
        )
    return seen.original.crop((left, top, right, bottom))


_OPERATORS: dict[type, Callable[..., Any]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
    ast.USub: operator.neg,
    ast.UAdd: operator.pos,
}
_FUNCTIONS: dict[str, Callable[..., float]] = {
    name: getattr(math, name)
    for name in ("sqrt", "sin", "cos", "tan", "asin", "acos", "atan", "log", "exp", "floor", "ceil")
} | {"abs": abs, "round": round, "radians": math.radians, "degrees": math.degrees}
_CONSTANTS = {"pi": math.pi, "e": math.e}
# Built-ins run in the trainer's process, so no input may take long: 9**9**9 or round(1, -10**9) would
# compute for minutes. Integers stay within _MAX_BITS (about 1200 digits) and round() within 15 digits.
_MAX_BITS = 4000
_MAX_ROUND_DIGITS = 15


def calculator(expression: str) -> str:
    """Evaluate arithmetic (+ - * / // % **, parentheses, pi, e, sqrt, trigonometry in radians, log):
    a syntax tree walk over numbers and those names only, never `eval`."""
    try:
        tree = ast.parse(expression.replace("^", "**"), mode="eval")
        value = _evaluate(tree.body)
    except ToolError:
        raise
    except (SyntaxError, ValueError, ZeroDivisionError, OverflowError, TypeError) as err:
        raise ToolError(f"cannot evaluate {expression!r}: {err}") from None
    if isinstance(value, float):
        value = round(value, 10)  # 2.0000000000000004 is 2 to anyone asking
        if value.is_integer() and abs(value) < 1e15:
            value = int(value)
    return repr(value)


def _bounded(value: Any) -> Any:
    if isinstance(value, int) and value.bit_length() > _MAX_BITS:
        raise ToolError(f"the result has more than {_MAX_BITS} bits")
    return value


def _evaluate(node: ast.AST) -> Any:
    if (
        isinstance(node, ast.Constant)
        and isinstance(node.value, (int, float))
        and not isinstance(node.value, bool)
    ):
        return node.value
    if isinstance(node, ast.Name) and node.id in _CONSTANTS:
        return _CONSTANTS[node.id]
    if isinstance(node, ast.UnaryOp) and type(node.op) in _OPERATORS:
        return _bounded(_OPERATORS[type(node.op)](_evaluate(node.operand)))
    if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
        left, right = _evaluate(node.left), _evaluate(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) * max(abs(left), 2).bit_length() > _MAX_BITS:
            raise ToolError(f"the power is too large (over {_MAX_BITS} bits)")
        return _bounded(_OPERATORS[type(node.op)](left, right))
    if (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Name)
        and node.func.id in _FUNCTIONS
        and not node.keywords
    ):
        args = [_evaluate(arg) for arg in node.args]
        if node.func.id == "round" and len(args) > 1 and abs(args[1]) > _MAX_ROUND_DIGITS:
            raise ToolError(f"round() takes at most {_MAX_ROUND_DIGITS} digits")
        return _bounded(_FUNCTIONS[node.func.id](*args))
    raise ToolError(
        f"unsupported expression {ast.unparse(node)!r}: use numbers, + - * / ** %, pi, e, sqrt, ..."
    )


IMAGE_ZOOM_SCHEMA = {
    "type": "object",
    "properties": {
        "bbox_2d": {
            "type": "array",
            "items": {"type": "number"},
            "minItems": 4,
            "maxItems": 4,
            "description": "The region to zoom into, [x1, y1, x2, y2]",
        },
        "image_index": {"type": "integer", "description": "Which image, 0 for the first (default 0)"},
    },
    "required": ["bbox_2d"],
}
CALCULATOR_SCHEMA = {
    "type": "object",
    "properties": {"expression": {"type": "string", "description": "Arithmetic, e.g. (3 + 4) * sqrt(2)"}},
    "required": ["expression"],
}

# name -> (function, description, JSON schema of the arguments)
BUILTIN_TOOLS: dict[str, tuple[Callable[..., Any], str, dict[str, Any]]] = {
    "image_zoom": (
        image_zoom,
        "Zoom into a region of an image to see its details at a higher resolution",
        IMAGE_ZOOM_SCHEMA,
    ),
    "calculator": (calculator, "Evaluate an arithmetic expression exactly", CALCULATOR_SCHEMA),
}
# The fixed options a built-in takes from its config entry (`kwargs`), each with the values it allows.
BUILTIN_OPTIONS: dict[str, dict[str, tuple[str, ...]]] = {
    "image_zoom": {"frame": BOX_FRAMES},
    "calculator": {},
}


def check_options(tool: str, options: dict[str, Any]) -> None:
    """Refuse an option a built-in does not take, or a value it does not know, naming the valid ones:
    `image_zoom` with `frame: norm100` would otherwise crop in the wrong coordinates without a word."""
    allowed = BUILTIN_OPTIONS[tool]
    for key, value in options.items():
        known = allowed.get(key)
        valid = known if known is not None else tuple(allowed)
        if known is not None and value in known:
            continue
        close = difflib.get_close_matches(str(value if known is not None else key), valid, n=1)
        hint = f" Did you mean {close[0]}?" if close else ""
        what = (
            f"kwargs {key}: {value!r} is not one of"
            if known is not None
            else f"unknown kwargs key {key!r}; its keys:"
        )
        raise ConfigError(f"agent.tools {tool}: {what} {', '.join(valid) or '(none)'}.{hint}")
