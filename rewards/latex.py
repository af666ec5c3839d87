"""A bounded reader of the LaTeX that geometry answers are written in (`\\frac`, `\\sqrt`, `\\pi`, implicit and
`\\cdot` products), building a sympy expression and refusing whatever could take unbounded time to evaluate:
exponents beyond `MAX_EXPONENT`, powers beyond 10^300, roots of degree beyond `MAX_EXPONENT` and nesting
beyond `MAX_DEPTH`. The `geometry` grader (`mmrl.rewards.geometry`) reads answers with it."""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from typing import TYPE_CHECKING

from mmrl.rewards.graders import lazy_import

if TYPE_CHECKING:
    import sympy
else:
    sympy = lazy_import("sympy")  # a second or more to import: loaded on the first answer that needs it

MAX_EXPONENT = 100
MAX_DEPTH = 32
_MAX_POWER_LOG10 = 300

# --- tokens -----------------------------------------------------------------------------------------------

_TOKEN = re.compile(r"\s*(\d+\.?\d*|\.\d+|\\[A-Za-z]+|[A-Za-z]|[-+*/^()\[\]{}])")
_CLOSING = {"(": ")", "[": "]", "{": "}"}
_GREEK = frozenset(
    "alpha beta gamma delta epsilon varepsilon zeta eta theta vartheta iota kappa lambda mu nu xi rho "
    "sigma tau upsilon phi varphi chi psi omega Gamma Delta Theta Lambda Xi Sigma Phi Psi Omega".split()
)


class Refused(ValueError):
    """Text the parser will not turn into a value: outside its grammar, or too costly to evaluate."""


def parse_latex(text: str) -> sympy.Expr:
    """`text` as a sympy expression; `Refused` when it is outside the grammar or too costly."""
    return _Parser(text).parse()


def _tokenize(text: str) -> list[str]:
    tokens: list[str] = []
    pos = 0
    while match := _TOKEN.match(text, pos):
        tokens.append(match.group(1))
        pos = match.end()
    if text[pos:].strip():
        raise Refused(f"unexpected {text[pos : pos + 10]!r}")
    return tokens


class _Parser:
    """Recursive descent over the LaTeX subset of geometry answers, building a sympy expression and
    refusing anything whose evaluation could run without bound.

    sum := product (("+" | "-") product)*; product := signed (("*" | "/")? signed)*, an implicit product
    needing a letter, command or bracket on its right (`2\\sqrt{3}`, not `2 3`); signed := sign* power;
    power := atom ("^" signed)?; atom := number | letter | greek | \\pi | bracketed sum |
    \\frac arg arg | \\sqrt ("[" sum "]")? arg.
    """

    def __init__(self, text: str):
        self._tokens = _tokenize(text)
        self._pos = 0
        self._depth = 0

    def parse(self) -> sympy.Expr:
        expr = self._sum()
        if self._pos != len(self._tokens):
            raise Refused(f"unexpected {self._peek()!r}")
        return expr

    def _peek(self) -> str:
        return self._tokens[self._pos] if self._pos < len(self._tokens) else ""

    def _take(self) -> str:
        token = self._peek()
        if not token:
            raise Refused("unexpected end")
        self._pos += 1
        return token

    def _nested(self, parse: Callable[[], sympy.Expr]) -> sympy.Expr:
        self._depth += 1
        if self._depth > MAX_DEPTH:
            raise Refused("nested too deeply")
        value = parse()
        self._depth -= 1
        return value

    def _sum(self) -> sympy.Expr:
        value = self._product()
        while self._peek() in ("+", "-"):
            value = value + self._product() if self._take() == "+" else value - self._product()
        return value

    def _product(self) -> sympy.Expr:
        value = self._signed()
        while True:
            token = self._peek()
            if token in ("*", "/"):
                self._take()
                value = value * self._signed() if token == "*" else value / self._signed()
            elif token and (token[0].isalpha() or token[0] == "\\" or token in _CLOSING):
                value = value * self._power()
            else:
                return value

    def _signed(self) -> sympy.Expr:
        negative = False
        while self._peek() in ("+", "-"):
            negative ^= self._take() == "-"
        value = self._power()
        return -value if negative else value

    def _power(self) -> sympy.Expr:
        base = self._atom()
        if self._peek() != "^":
            return base
        self._take()
        return _bounded_power(base, self._nested(self._signed))

    def _atom(self) -> sympy.Expr:
        token = self._take()
        if token[0].isdigit() or token[0] == ".":
            return sympy.Rational(token)
        if token.isalpha():
            return sympy.Symbol(token)
        if token in _CLOSING:
            value = self._nested(self._sum)
            if self._take() != _CLOSING[token]:
                raise Refused(f"unclosed {token!r}")
            return value
        if token == r"\pi":
            return sympy.pi
        if token == r"\frac":
            numerator = self._nested(self._atom)
            return numerator / self._nested(self._atom)
        if token == r"\sqrt":
            return self._root()
        if token[1:] in _GREEK:
            return sympy.Symbol(token[1:])
        raise Refused(f"unsupported {token!r}")

    def _root(self) -> sympy.Expr:
        degree = 2
        if self._peek() == "[":
            self._take()
            index = self._nested(self._sum)
            if self._take() != "]" or not index.is_Integer or not 2 <= int(index) <= MAX_EXPONENT:
                raise Refused("root degree must be an integer from 2 to MAX_EXPONENT")
            degree = int(index)
        return sympy.root(self._nested(self._atom), degree)


def _bounded_power(base: sympy.Expr, exponent: sympy.Expr) -> sympy.Expr:
    """`base ** exponent`, refused for a variable or large exponent or a result beyond 10^300: sympy
    evaluates integer powers exactly, and 9^(9^9) alone has 370 million digits."""
    if exponent.free_symbols:
        raise Refused("variable exponent")
    power = complex(exponent.evalf(15))
    if power.imag or not abs(power.real) <= MAX_EXPONENT:
        raise Refused("exponent too large")
    if not base.free_symbols:
        magnitude = abs(complex(base.evalf(15)))
        if magnitude and not abs(power.real * math.log10(magnitude)) <= _MAX_POWER_LOG10:
            raise Refused("power too large")
    return base**exponent
