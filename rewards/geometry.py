"""The `geometry` grader: does a response's final answer equal the ground truth, written the ways
Geometry3K- and MathVerse-style answers are written?

Both sides are cleaned into a canonical string and, where possible, a number: a small parser of our own
reads the LaTeX subset these answers use (`mmrl.rewards.latex`: `\\frac`, `\\sqrt`, `\\pi`, implicit and `\\cdot` products)
into a sympy expression, which is then evaluated. Sympy only sees what the parser built (never
`sympify`, which evals), and nothing a model writes can make the grader work without bound:

* answers longer than `MAX_ANSWER_CHARS` are refused, and the parser refuses exponents beyond
  `MAX_EXPONENT`, powers beyond 10^300, roots of degree beyond `MAX_EXPONENT` and nesting beyond
  `MAX_DEPTH`; factorials and unknown commands are not in its grammar at all;
* expressions with variables are compared at fixed probe points, not with `simplify`, whose running time
  has no useful bound;
* a SIGALRM deadline backs these up where signals can be used (see `deadline`). The bounds are needed
  even with it: Python runs signal handlers only between bytecodes, so one huge big-integer power inside
  C would outlast any alarm.

Matching rules, the choices a grader has to make:

* Two whole numbers match only exactly (counts and lengths like 123456 vs 123457 must not pass on
  tolerance). Other numbers match within `rel_tol`. A rounded decimal also matches the value it was rounded from, to the
  places it was written to (within half a unit of its last place): a ground truth written to k places
  accepts any answer at least as precise (truth 17.3 accepts 10\\sqrt{3}, 17.32 and 17.34, not 17 or
  17.4); an answer written to k places, with at least 3 significant digits, matches a ground truth
  written exactly (1.73 and 1.732 match \\sqrt{3}; 1.7 does not, or coarse rounding would collect reward).
* `x%` reads as x and as x/100, so 50% matches 50 and 0.5. `x°` reads as x and as x·π/180, so 60°
  matches 60 and \\frac{\\pi}{3}; without a degree sign nothing is converted: \\frac{\\pi}{3} is not 60.
* Units and labels are dropped: `AB = 5 cm` is 5. Of `x = a ≈ b` the answer is the exact a.
* `1,000` (comma-separated groups of three digits) is one thousand; any other top-level comma separates
  tuple elements, compared in order.
* Equal canonical strings match (case-insensitively), which covers answers that are words.
* Multiple choice (`extra["choices"]`, lettered A, B, ...): a letter answer stands for its choice; a
  choice-text answer matches a letter ground truth when that choice is the one it matches best (exactly
  if any choice does, else within the tolerances above).
"""

from __future__ import annotations

import cmath
import math
import random
import re
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache
from numbers import Real
from typing import TYPE_CHECKING

from mmrl.rewards.deadline import Timeout, deadline
from mmrl.rewards.graders import extract_answer, lazy_import, register_grader
from mmrl.rewards.latex import Refused, parse_latex
from mmrl.rewards.types import RewardInput

if TYPE_CHECKING:
    import sympy
else:
    # sympy takes a second or more to import: loaded on the first answer that needs it, not by every
    # process that imports `rewards` (each reward worker, the CLI).
    sympy = lazy_import("sympy")

MAX_ANSWER_CHARS = 256
# A reply this short on one line, with no box, tag or "Answer:", is taken as the answer itself.
_BARE_MAX_CHARS = 40
_PROBES = 3
_ABS_TOL = 1e-9
_EXACT_TOL = 1e-12

# --- cleaning: one spelling for everything the parser reads ----------------------------------------------

_UNICODE = str.maketrans(
    {
        "−": "-",
        "–": "-",
        "×": "*",
        "·": "*",
        "⋅": "*",
        "÷": "/",
        "π": r"\pi ",
        "²": "^2",
        "³": "^3",
        "，": ",",
    }
)
_DELIMITERS = re.compile(r"\$|\\[()\[\]]")
_THIN_SPACE = re.compile(r"\\[,;:! ]")
_WIDE_SPACE = re.compile(r"~|\\(?:q?quad|left|right|displaystyle)(?![A-Za-z])")
_TEXT = re.compile(r"\\(?:text|textbf|textit|textrm|mathrm|mathbf|mathit|mbox|operatorname)\s*\{([^{}]*)\}")
_UNICODE_ROOT = re.compile(r"√\s*(\d+(?:\.\d+)?|[A-Za-z])")
_WORD_SQRT = re.compile(r"(?<![A-Za-z\\])sqrt")
_WORD_PI = re.compile(r"(?<![A-Za-z\\])pi(?![A-Za-z])")
_FRAC = re.compile(r"\\[dt]frac(?![A-Za-z])")
# LaTeX lets a one-character argument go without braces: \frac12, \sqrt3.
_BARE_FRAC = re.compile(r"\\frac\s*([0-9A-Za-z])\s*([0-9A-Za-z])")
_BARE_SQRT = re.compile(r"\\sqrt\s*([0-9A-Za-z])")
_TIMES = re.compile(r"\\(?:cdot|times|ast)(?![A-Za-z])")
_DIVIDE = re.compile(r"\\div(?![A-Za-z])")
_WRAPPERS = " \t\r\n'\"`*"
_TRAILING = ".,;:!?"

# --- which part of the answer is the value ---------------------------------------------------------------

_SEPARATOR = re.compile(r"((?<![<>!])=|\\approx(?![A-Za-z])|≈|\bis\b)")
_LABEL_MARK = re.compile(r"\\(?:angle|measuredangle|triangle|overline|overarc|widehat|arc|odot)(?![A-Za-z])")
_COMMAND = re.compile(r"\\[A-Za-z]+")
_PERCENT = re.compile(r"\\?%$")
_DEGREE = re.compile(r"(?:\^\s*\{?\s*\\circ\s*\}?|\\circ|°|\\degree|(?<![A-Za-z])(?:degrees?|deg))$")
_UNIT = re.compile(
    r"(?<![A-Za-z\\])(?:(?:square|sq\.?|cubic)\s*)?"
    r"(?:units?|(?:centi|milli|kilo)?met(?:er|re)s?|[ckm]?m|in(?:ch(?:es)?)?|ft|feet|foot|yd|yards?"
    r"|mi(?:les?)?|radians?|rad)"
    r"(?:\s*\^\s*\{?\s*[23]\s*\}?|\s+(?:squared|cubed))?$"
)
_THOUSANDS = re.compile(r"[+-]?\d{1,3}(?:,\d{3})+(?:\.\d+)?")
_DECIMAL = re.compile(r"[+-]?(\d*)(?:\.(\d*))?")
_LETTER = re.compile(
    r"(?:(?:option|choice)\s*)?(?:\(([A-Z])\)(?:\s*\S.*)?|([A-Z])(?:[.:)](?:\s+\S.*)?)?)",
    re.DOTALL | re.IGNORECASE,
)


@dataclass(frozen=True)
class _Reading:
    """One way to read a value: its value at each probe point (a single point when it has no variables)
    and, for a decimal literal, the places and significant digits it was written with."""

    values: tuple[complex, ...]
    places: int | None = None
    digits: int = 0


@dataclass(frozen=True)
class _Answer:
    """A parsed answer: its canonical text and, if it is a number or tuple of numbers, the readings of
    each element (`None` when it is not)."""

    key: str
    elements: tuple[tuple[_Reading, ...], ...] | None


@register_grader("geometry")
def geometry(sample: RewardInput, rel_tol: float = 1e-4, timeout_s: float = 1.0) -> float:
    """1.0 if the response's final answer equals `sample.ground_truth` (a string or number) under the
    rules in this module's docstring, else 0.0. Malformed, oversized or too costly answers score 0.0
    rather than raise: they are model output, not bugs."""
    answer = extract_answer(sample.response, bare_max_chars=_BARE_MAX_CHARS)
    truth = sample.ground_truth
    if answer is None or len(answer) > MAX_ANSWER_CHARS:
        return 0.0
    if isinstance(truth, bool) or not isinstance(truth, (str, Real)):
        return 0.0
    choices = _choices(sample.extra.get("choices"))
    sympy.Expr  # noqa: B018  (loads the lazily imported sympy here, not inside the answer's time limit)
    try:
        with deadline(timeout_s):
            return float(_grade(answer, str(truth), choices, rel_tol))
    except Timeout:
        return 0.0


def _choices(raw: object) -> tuple[str, ...]:
    """The dataset's options as text, A first; none unless it is a list of strings or numbers."""
    if not isinstance(raw, (list, tuple)) or not 0 < len(raw) <= 26:
        return ()
    if not all(isinstance(choice, (str, Real)) and not isinstance(choice, bool) for choice in raw):
        return ()
    return tuple(str(choice) for choice in raw)


def _grade(answer: str, truth: str, choices: Sequence[str], rel_tol: float) -> bool:
    """Letters stand for their choices when the dataset gives choices; otherwise compare the values."""
    count = len(choices) or 26
    picked, expected = _letter(answer, count), _letter(truth, count)
    if picked is not None and expected is not None:
        return picked == expected
    if picked is not None and choices:
        return _matches(_parse(choices[picked]), _parse(truth), rel_tol)
    if expected is not None and choices:
        return expected in _best_choices(_parse(answer), choices, rel_tol)
    return _matches(_parse(answer), _parse(truth), rel_tol)


@lru_cache(maxsize=4096)
def _letter(text: str, count: int) -> int | None:
    """The option `text` names (`B`, `(B)`, `B.`, `(B) 12`, `Option B`) as an index below `count`."""
    match = _LETTER.fullmatch(_clean(text)) if len(text) <= MAX_ANSWER_CHARS else None
    if match is None:
        return None
    index = ord((match.group(1) or match.group(2)).upper()) - ord("A")
    return index if index < count else None


def _best_choices(answer: _Answer, choices: Sequence[str], rel_tol: float) -> set[int]:
    """Indices of the choices `answer` matches: the exact matches if there are any, else those within
    tolerance, so that 1.73 picks a "1.73" choice over a "\\sqrt{3}" one."""
    parsed = [_parse(choice) for choice in choices]
    exact = {i for i, choice in enumerate(parsed) if _matches(answer, choice, _EXACT_TOL, rounding=False)}
    return exact or {i for i, choice in enumerate(parsed) if _matches(answer, choice, rel_tol)}


def _matches(answer: _Answer, truth: _Answer, rel_tol: float, rounding: bool = True) -> bool:
    """Same canonical text, or the same number of elements with each matching under some reading."""
    if answer.key and answer.key == truth.key:
        return True
    if answer.elements is None or truth.elements is None or len(answer.elements) != len(truth.elements):
        return False
    return all(
        any(_same(a, t, rel_tol, rounding) for a in readings for t in truth_readings)
        for readings, truth_readings in zip(answer.elements, truth.elements, strict=True)
    )


def _same(answer: _Reading, truth: _Reading, rel_tol: float, rounding: bool) -> bool:
    """Equal within `rel_tol` at every probe point or, for numbers, within the rounding slack."""
    if len(answer.values) != len(truth.values):
        return False
    pairs = list(zip(answer.values, truth.values, strict=True))
    if all(_integral(a) and _integral(t) for a, t in pairs):  # counts are exact: 123456 is not 123457
        return all(a == t for a, t in pairs)
    if all(cmath.isclose(a, t, rel_tol=rel_tol, abs_tol=_ABS_TOL) for a, t in pairs):
        return True
    if not rounding or len(answer.values) != 1:
        return False
    slack = _rounding_slack(answer, truth)
    a, t = answer.values[0], truth.values[0]
    return slack > 0 and abs(a - t) <= slack + 1e-9 * max(abs(a), abs(t))


def _integral(value: complex) -> bool:
    """A real whole number small enough for floats to hold exactly."""
    return value.imag == 0 and value.real.is_integer() and abs(value.real) < 2**53


def _rounding_slack(answer: _Reading, truth: _Reading) -> float:
    """How far a rounded decimal may be from the value it was rounded from (see the module docstring)."""
    slack = 0.0
    if truth.places is not None and (answer.places is None or answer.places >= truth.places):
        slack = 0.5 * 10.0**-truth.places
    if answer.places is not None and answer.digits >= 3 and truth.places is None:
        slack = max(slack, 0.5 * 10.0**-answer.places)
    return slack


@lru_cache(maxsize=16384)
def _parse(text: str) -> _Answer:
    """`text` as an answer. Cached: a ground truth (and often an answer) repeats across a group's samples."""
    if len(text) > MAX_ANSWER_CHARS:
        return _Answer("", None)
    value, percent, degree = _undecorate(_value_part(_clean(text)))
    try:
        elements = _elements(value, percent, degree)
    except Exception:  # Refused, or what sympy raises on input it cannot handle: either way, no value.
        elements = None
    return _Answer("".join(value.split()).casefold(), elements)


def _clean(text: str) -> str:
    """Drop what does not change an answer (math delimiters, spacing, `\\text{}` wrappers, surrounding
    quotes and punctuation) and spell operators, roots and fractions one way."""
    text = _trim(_DELIMITERS.sub(" ", text.translate(_UNICODE)))  # before `**` becomes `^`: **B** is bold
    text = _WIDE_SPACE.sub(" ", _THIN_SPACE.sub("", text))
    previous = None
    while previous != text:  # \text{} inside \textbf{}: one layer per pass
        previous, text = text, _TEXT.sub(r"\1", text)
    text = _UNICODE_ROOT.sub(r"\\sqrt{\1}", text).replace("√", r"\sqrt")
    text = _WORD_PI.sub(r"\\pi ", _WORD_SQRT.sub(r"\\sqrt", text))
    text = _BARE_FRAC.sub(r"\\frac{\1}{\2}", _FRAC.sub(r"\\frac", text))
    text = _BARE_SQRT.sub(r"\\sqrt{\1}", text)
    text = _DIVIDE.sub("/", _TIMES.sub("*", text.replace("**", "^")))
    return _trim(text)


def _trim(text: str) -> str:
    previous = None
    while previous != text:
        previous, text = text, text.strip(_WRAPPERS).rstrip(_TRAILING)
    return text


def _value_part(text: str) -> str:
    """The value in `lhs = value`, `lhs is value` or `lhs = exact ≈ approximation`: the last part, or the
    part before a final approximation sign unless that part is a label (`x ≈ 3.46`)."""
    pieces = _SEPARATOR.split(text)
    values, separators = pieces[::2], pieces[1::2]
    exact = values[-2] if separators and separators[-1] not in ("=", "is") else ""
    return _trim(exact if exact.strip() and not _is_label(exact) else values[-1])


def _is_label(text: str) -> bool:
    """True for names like `x`, `AB`, `m\\angle ABC`: a letter outside a command, or an angle-like mark."""
    return bool(_LABEL_MARK.search(text) or re.search("[A-Za-z]", _COMMAND.sub("", text)))


def _undecorate(text: str) -> tuple[str, bool, bool]:
    """`text` without trailing units, degree signs and percent signs, and whether it had the latter two."""
    percent = degree = False
    while True:
        text = _trim(text)
        if (match := _PERCENT.search(text)) and match.start() > 0:
            percent = True
        elif (match := _DEGREE.search(text)) and match.start() > 0:
            degree = True
        elif not ((match := _UNIT.search(text)) and match.start() > 0):
            return text, percent, degree
        text = text[: match.start()]


def _elements(text: str, percent: bool, degree: bool) -> tuple[tuple[_Reading, ...], ...]:
    if _THOUSANDS.fullmatch(text):
        return (_readings(text.replace(",", ""), percent, degree),)
    parts = _tuple_parts(text)
    if len(parts) == 1:
        return (_readings(text, percent, degree),)
    return tuple(_readings(*_undecorate(part)) for part in parts)


def _tuple_parts(text: str) -> list[str]:
    """The elements of `(a, b)`, `[a, b]` or `a, b`; `[text]` when there is no top-level comma."""
    inner = text[1:-1] if text[:1] in "([" and text[-1:] in ")]" and _encloses(text) else text
    parts: list[str] = []
    depth = start = 0
    for i, char in enumerate(inner):
        if char in "([{":
            depth += 1
        elif char in ")]}":
            depth -= 1
        elif char == "," and depth == 0:
            parts.append(inner[start:i])
            start = i + 1
    parts.append(inner[start:])
    return parts if len(parts) > 1 else [text]


def _encloses(text: str) -> bool:
    """True if the bracket opening `text` closes at its last character."""
    depth = 0
    for i, char in enumerate(text):
        depth += (char in "([{") - (char in ")]}")
        if depth == 0:
            return i == len(text) - 1
    return False


def _readings(text: str, percent: bool, degree: bool) -> tuple[_Reading, ...]:
    """Every way to read `text`: as written, and also as a fraction (`%`) or in radians (`°`)."""
    reading = _decimal(text) or _Reading(_evaluate(parse_latex(text)))
    readings = [reading]
    if percent:
        places = None if reading.places is None else reading.places + 2
        readings.append(_Reading(tuple(v / 100 for v in reading.values), places, reading.digits))
    if degree:
        readings.append(_Reading(tuple(v * math.pi / 180 for v in reading.values)))
    return tuple(readings)


def _decimal(text: str) -> _Reading | None:
    """Fast path for a plain number: no sympy. Records the places and significant digits it was written
    with, for the rounding rule."""
    match = _DECIMAL.fullmatch(text)
    if match is None or not (match.group(1) or match.group(2)):
        return None
    value = float(text)
    if not math.isfinite(value):
        raise Refused("number out of range")
    whole, fraction = match.group(1), match.group(2) or ""
    return _Reading((complex(value),), len(fraction) or None, len((whole + fraction).lstrip("0")))


def _evaluate(expr: sympy.Expr) -> tuple[complex, ...]:
    """`expr`'s value, or its values at fixed probe points when it has variables: two expressions that
    agree at several generic points are taken to be equal, which unlike `simplify` has bounded cost."""
    symbols = sorted(expr.free_symbols, key=str)
    if not symbols:
        return (_finite(expr.evalf(15)),)
    return tuple(
        _finite(expr.evalf(15, subs={symbol: _probe(symbol.name, k) for symbol in symbols}))
        for k in range(_PROBES)
    )


def _probe(name: str, k: int) -> float:
    """The k-th value tried for a variable; a function of its name only, so every answer and ground
    truth sees the same values (a str seed is hashed with SHA-512, independent of PYTHONHASHSEED)."""
    return random.Random(f"{name}/{k}").uniform(0.5, 2.5)


def _finite(value: sympy.Expr) -> complex:
    number = complex(value)
    if not cmath.isfinite(number):
        raise Refused("not a finite number")
    return number
