"""Tests for the `geometry` grader: Geometry3K/MathVerse answer formats, near misses, malformed and
adversarial output, its deadline, and its agreement with math-verify on the same cases."""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from types import FrameType

import pytest

import mmrl.rewards.deadline as deadline_module
import mmrl.rewards.geometry as geometry_module
from mmrl.rewards import GRADERS, RewardInput, RewardManager, extract_answer
from mmrl.rewards.geometry import geometry

ABCD = ["3", "4", "5", "6"]
ROOTS = [r"2\sqrt{3}", r"3\sqrt{2}", r"4\sqrt{3}", "6"]
ANGLES = ["30", "45", "60", "90"]
NEAR = ["1.73", r"\sqrt{3}", "2", "3"]

# (id, response, ground truth, expected score, choices). Ids name the cases math-verify disagrees on.
CASES: list[tuple[str, str, object, float, list[object] | None]] = [
    # --- where the answer is, and plain numbers
    ("boxed", r"The perimeter is $\boxed{12}$.", "12", 1.0, None),
    ("boxed-wrong", r"\boxed{13}", "12", 0.0, None),
    ("answer-tag", "<think>3 * 4</think><answer>12</answer>", "12", 1.0, None),
    ("answer-line", "The sides are 3, 4 and 5.\nAnswer: 12", "12", 1.0, None),
    ("answer-is", "Adding the sides, the answer is 12.", "12", 1.0, None),
    ("bare-number", "12", "12", 1.0, None),
    ("int-truth", r"\boxed{12}", 12, 1.0, None),
    ("float-truth", r"\boxed{7.5}", 7.5, 1.0, None),
    ("float-truth-wrong", r"\boxed{7.6}", 7.5, 0.0, None),
    ("negative", r"\boxed{-3}", "-3", 1.0, None),
    ("negative-sign-lost", r"\boxed{3}", "-3", 0.0, None),
    ("unicode-minus", r"\boxed{−4}", "-4", 1.0, None),
    ("leading-dot", r"\boxed{.5}", "0.5", 1.0, None),
    ("trailing-zero", r"\boxed{12.0}", "12", 1.0, None),
    ("truth-trailing-zeros", r"\boxed{12}", "12.00", 1.0, None),
    ("last-box-wins", r"First \boxed{10}; correcting that, \boxed{12}", "12", 1.0, None),
    ("earlier-box-ignored", r"\boxed{12}, no wait: \boxed{10}", "12", 0.0, None),
    ("sixty-vs-six", r"\boxed{60}", "6", 0.0, None),
    ("six-vs-sixty", r"\boxed{6}", "60", 0.0, None),
    ("digits-swapped", r"\boxed{21}", "12", 0.0, None),
    ("large-equal", r"\boxed{1024}", "1024", 1.0, None),
    ("large-off-by-one", r"\boxed{1025}", "1024", 0.0, None),
    # --- fractions
    ("frac-vs-decimal", r"\boxed{\frac{3}{4}}", "0.75", 1.0, None),
    ("dfrac", r"\boxed{\dfrac{3}{4}}", r"\frac{3}{4}", 1.0, None),
    ("tfrac", r"\boxed{\tfrac{3}{4}}", "3/4", 1.0, None),
    ("slash-vs-frac", r"\boxed{3/4}", r"\frac{3}{4}", 1.0, None),
    ("frac-inverted", r"\boxed{\frac{4}{3}}", r"\frac{3}{4}", 0.0, None),
    ("slash-inverted", r"\boxed{4/3}", "3/4", 0.0, None),
    ("frac-bare-args", r"\boxed{\frac34}", "0.75", 1.0, None),
    ("frac-unreduced", r"\boxed{\frac{6}{8}}", r"\frac{3}{4}", 1.0, None),
    ("frac-improper", r"\boxed{\frac{15}{2}}", "7.5", 1.0, None),
    ("frac-negative", r"\boxed{-\frac{1}{2}}", "-0.5", 1.0, None),
    ("frac-negative-numerator", r"\boxed{\frac{-1}{2}}", r"-\frac12", 1.0, None),
    ("frac-sqrt-numerator", r"\boxed{\frac{\sqrt{3}}{2}}", r"\frac{1}{2}\sqrt{3}", 1.0, None),
    ("frac-sqrt-vs-rounded", r"\boxed{\frac{\sqrt{3}}{2}}", "0.866", 1.0, None),
    ("frac-rationalised", r"\boxed{\frac{1}{\sqrt{2}}}", r"\frac{\sqrt{2}}{2}", 1.0, None),
    ("frac-wrong-denominator", r"\boxed{\frac{3}{5}}", r"\frac{3}{4}", 0.0, None),
    ("frac-vs-rounded-truth", r"\boxed{\frac{2}{3}}", "0.67", 1.0, None),
    ("rounded-answer-3-digits", r"\boxed{0.667}", r"\frac{2}{3}", 1.0, None),
    ("truncated-answer-2-digits", r"\boxed{0.66}", r"\frac{2}{3}", 0.0, None),
    ("third-rounded", r"\boxed{0.333}", "1/3", 1.0, None),
    # --- roots
    ("sqrt-simplified", r"\boxed{2\sqrt{3}}", r"\sqrt{12}", 1.0, None),
    ("sqrt-bare-arg", r"\boxed{2\sqrt3}", r"2\sqrt{3}", 1.0, None),
    ("sqrt-unicode", r"\boxed{2√3}", r"2\sqrt{3}", 1.0, None),
    ("sqrt-plain-text", "Answer: 2sqrt(3)", r"2\sqrt{3}", 1.0, None),
    ("sqrt-2-vs-3", r"\boxed{\sqrt{2}}", r"\sqrt{3}", 0.0, None),
    ("sqrt-coefficient-swapped", r"\boxed{3\sqrt{2}}", r"2\sqrt{3}", 0.0, None),
    ("sqrt-cube-root", r"\boxed{\sqrt[3]{8}}", "2", 1.0, None),
    ("sqrt-rounded-3", r"\boxed{1.732}", r"\sqrt{3}", 1.0, None),
    ("sqrt-rounded-2", r"\boxed{1.73}", r"\sqrt{3}", 1.0, None),
    ("sqrt-too-coarse", r"\boxed{1.7}", r"\sqrt{3}", 0.0, None),
    ("sqrt-wrong-last-digit", r"\boxed{1.74}", r"\sqrt{3}", 0.0, None),
    ("sqrt-sum-reordered", r"\boxed{3+\sqrt{5}}", r"\sqrt{5}+3", 1.0, None),
    ("sqrt-product", r"\boxed{\sqrt{2}\cdot\sqrt{8}}", "4", 1.0, None),
    ("sqrt-nested", r"\boxed{\sqrt{\sqrt{16}}}", "2", 1.0, None),
    ("sqrt-vs-rounded-truth", r"\boxed{4\sqrt{2}}", "5.66", 1.0, None),
    ("rounded-wrong-way", r"\boxed{5.65}", r"4\sqrt{2}", 0.0, None),
    ("sqrt-vs-truth-1-place", r"\boxed{8\sqrt{2}}", "11.3", 1.0, None),
    ("more-places-than-truth", r"\boxed{11.31}", "11.3", 1.0, None),
    ("fewer-places-than-truth", r"\boxed{11}", "11.3", 0.0, None),
    ("coarser-than-truth", r"\boxed{11.3}", "11.31", 0.0, None),
    ("sqrt-of-non-square", r"\boxed{\sqrt{50}}", r"5\sqrt{2}", 1.0, None),
    ("sqrt-rounded-4-digits", r"\boxed{7.071}", r"5\sqrt{2}", 1.0, None),
    ("sqrt-rounded-2-digits", r"\boxed{7.1}", r"5\sqrt{2}", 0.0, None),
    # --- pi
    ("pi", r"\boxed{6\pi}", "6π", 1.0, None),
    ("pi-reordered", r"\boxed{\pi \cdot 6}", r"6\pi", 1.0, None),
    ("pi-rounded", r"\boxed{18.85}", r"6\pi", 1.0, None),
    ("pi-vs-rounded-truth", r"\boxed{6\pi}", "18.85", 1.0, None),
    ("pi-plain-text", "Answer: 6pi", r"6\pi", 1.0, None),
    ("pi-dropped", r"\boxed{6}", r"6\pi", 0.0, None),
    ("pi-doubled", r"\boxed{12\pi}", r"6\pi", 0.0, None),
    ("pi-in-fraction", r"\boxed{\frac{25\pi}{4}}", r"\frac{25}{4}\pi", 1.0, None),
    ("pi-area-rounded", r"\boxed{113.1}", r"36\pi", 1.0, None),
    ("pi-area-vs-rounded-truth", r"\boxed{36\pi}", "113.1", 1.0, None),
    ("pi-3.14", r"\boxed{3.14}", r"\pi", 1.0, None),
    ("pi-3.15", r"\boxed{3.15}", r"\pi", 0.0, None),
    ("pi-times-rounded", r"\boxed{28.27}", r"9\pi", 1.0, None),
    # --- products
    ("cdot", r"\boxed{2 \cdot 3}", "6", 1.0, None),
    ("times", r"\boxed{4 \times 5}", "20", 1.0, None),
    ("unicode-times", r"\boxed{4×5}", "20", 1.0, None),
    ("star", r"\boxed{2*3}", "6", 1.0, None),
    ("implicit-bracket", r"\boxed{2(3+4)}", "14", 1.0, None),
    ("implicit-roots", r"\boxed{3\sqrt{2}\sqrt{2}}", "6", 1.0, None),
    ("product-wrong", r"\boxed{2 \cdot 4}", "6", 0.0, None),
    # --- degrees
    ("deg-circ", r"\boxed{60^\circ}", "60", 1.0, None),
    ("deg-braced-circ", r"\boxed{60^{\circ}}", "60", 1.0, None),
    ("deg-sign", r"\boxed{60°}", "60", 1.0, None),
    ("deg-word", "The angle measures 60 degrees.\nAnswer: 60 degrees", "60", 1.0, None),
    ("deg-command", r"\boxed{60\degree}", "60", 1.0, None),
    ("deg-in-truth", r"\boxed{60}", "60°", 1.0, None),
    ("deg-wrong", r"\boxed{30^\circ}", "60", 0.0, None),
    ("deg-decimal", r"\boxed{22.5^\circ}", "22.5", 1.0, None),
    ("deg-to-radians", r"\boxed{60^\circ}", r"\frac{\pi}{3}", 1.0, None),
    ("radians-for-degrees", r"\boxed{\frac{\pi}{3}}", "60", 0.0, None),
    ("radians-for-degree-sign", r"\boxed{\frac{\pi}{3}}", "60^\\circ", 1.0, None),
    ("radians-decimal-for-degrees", r"\boxed{1.047}", "60", 0.0, None),
    ("angle-label", r"\boxed{m\angle ABC = 60^\circ}", "60", 1.0, None),
    ("angle-number-label", r"\boxed{\angle 1 = 45^\circ}", "45", 1.0, None),
    # --- units
    ("unit-cm", r"\boxed{12 cm}", "12", 1.0, None),
    ("unit-text-cm", r"\boxed{12\text{ cm}}", "12", 1.0, None),
    ("unit-spaced-text", r"\boxed{12\ \text{cm}}", "12", 1.0, None),
    ("unit-mathrm", r"\boxed{12\,\mathrm{cm}}", "12", 1.0, None),
    ("unit-m", r"\boxed{12 m}", "12", 1.0, None),
    ("unit-units", r"\boxed{12 units}", "12", 1.0, None),
    ("unit-units-squared", r"\boxed{12 units^2}", "12", 1.0, None),
    ("unit-units-superscript", r"\boxed{12 units²}", "12", 1.0, None),
    ("unit-cm2", r"\boxed{12 cm^2}", "12", 1.0, None),
    ("unit-text-braced-power", r"\boxed{12 \text{cm}^{2}}", "12", 1.0, None),
    ("unit-square-units", "Answer: 12 square units", "12", 1.0, None),
    ("unit-mathrm-tilde", r"\boxed{12 \mathrm{~cm}^2}", "12", 1.0, None),
    ("unit-inches", r"\boxed{12 inches}", "12", 1.0, None),
    ("unit-ft", r"\boxed{12 ft}", "12", 1.0, None),
    ("unit-wrong-value", r"\boxed{13 cm}", "12", 0.0, None),
    ("unit-in-truth", r"\boxed{12}", "12 cm", 1.0, None),
    ("unit-after-root", r"\boxed{5\sqrt{2} \text{ cm}}", r"5\sqrt{2}", 1.0, None),
    # --- equations and labels
    ("eq-x", r"\boxed{x = 5}", "5", 1.0, None),
    ("eq-segment", r"\boxed{AB = 5}", "5", 1.0, None),
    ("eq-both-sides", r"\boxed{x=5}", "x = 5", 1.0, None),
    ("eq-other-variable", r"\boxed{y = 5}", "5", 1.0, None),
    ("eq-wrong", r"\boxed{x = 5}", "6", 0.0, None),
    ("eq-chain", r"\boxed{AB = BC = 7}", "7", 1.0, None),
    ("eq-overline", r"\boxed{\overline{AB} = 10}", "10", 1.0, None),
    ("approx-label", r"\boxed{x \approx 3.46}", r"2\sqrt{3}", 1.0, None),
    ("approx-after-exact", r"\boxed{x = 2\sqrt{3} \approx 3.46}", r"2\sqrt3", 1.0, None),
    ("approx-coarse-after-exact", r"\boxed{x = 2\sqrt{3} \approx 3.5}", r"2\sqrt3", 1.0, None),
    ("coarse-only", r"\boxed{x = 3.5}", r"2\sqrt3", 0.0, None),
    ("approx-only", r"\boxed{\approx 3.46}", r"2\sqrt3", 1.0, None),
    ("inequality-not-equation", r"\boxed{x >= 5}", "5", 0.0, None),
    ("sentence-in-tags", "<answer>The length of AB is 10</answer>", "10", 1.0, None),
    ("symbolic-reordered", r"\boxed{2x+1}", "1+2x", 1.0, None),
    ("symbolic-expanded", r"\boxed{x^2+2x+1}", "(x+1)^2", 1.0, None),
    ("symbolic-wrong", r"\boxed{2x-1}", "2x+1", 0.0, None),
    ("symbolic-greek", r"\boxed{\frac{\theta}{2}}", r"0.5\theta", 1.0, None),
    # --- wrappers, punctuation, separators
    ("dollars", "Answer: $12$", "12", 1.0, None),
    ("paren-delimiters", r"Answer: \(12\)", "12", 1.0, None),
    ("bracket-delimiters", r"Answer: \[12\]", "12", 1.0, None),
    ("trailing-period", "Answer: 12.", "12", 1.0, None),
    ("markdown-bold", "**Answer: 12**", "12", 1.0, None),
    ("thousands", r"\boxed{1,000}", "1000", 1.0, None),
    ("thousands-vs-one", r"\boxed{1,000}", "1", 0.0, None),
    ("thousands-decimal", r"\boxed{12,345.5}", "12345.5", 1.0, None),
    ("thousands-in-truth", r"\boxed{2500}", "2,500", 1.0, None),
    ("tuple", r"\boxed{(3, 4)}", "(3,4)", 1.0, None),
    ("tuple-swapped", r"\boxed{(4, 3)}", "(3,4)", 0.0, None),
    ("tuple-unbracketed", r"\boxed{3, 4}", "(3, 4)", 1.0, None),
    ("tuple-not-thousands", r"\boxed{1,5}", "15", 0.0, None),
    ("tuple-exact-forms", r"\boxed{(\frac{1}{2}, \sqrt{3})}", r"(0.5, \sqrt3)", 1.0, None),
    ("word-answer", r"\boxed{\text{isosceles}}", "Isosceles", 1.0, None),
    ("word-answer-wrong", r"\boxed{\text{scalene}}", "isosceles", 0.0, None),
    # --- percentages
    ("percent-vs-fraction", r"\boxed{50\%}", "0.5", 1.0, None),
    ("percent-vs-number", r"\boxed{50\%}", "50", 1.0, None),
    ("fraction-vs-percent-truth", r"\boxed{0.5}", "50%", 1.0, None),
    ("number-vs-percent-truth", r"\boxed{50}", "50%", 1.0, None),
    ("percent-wrong", r"\boxed{25\%}", "0.5", 0.0, None),
    ("percent-rounded", r"\boxed{33.3\%}", r"\frac{1}{3}", 1.0, None),
    ("percent-off-by-ten", r"\boxed{5\%}", "0.5", 0.0, None),
    # --- multiple choice
    ("mc-boxed-letter", r"\boxed{C}", "C", 1.0, ABCD),
    ("mc-paren-letter", "Answer: (C)", "C", 1.0, ABCD),
    ("mc-letter-period", "Answer: C.", "C", 1.0, ABCD),
    ("mc-bare-letter", "C", "C", 1.0, ABCD),
    ("mc-answer-is-letter", "Comparing the options, the answer is (C).", "C", 1.0, ABCD),
    ("mc-text-letter", r"\boxed{\text{C}}", "C", 1.0, ABCD),
    ("mc-option-word", "Answer: Option C", "C", 1.0, ABCD),
    ("mc-letter-and-text", "Answer: (C) 5", "C", 1.0, ABCD),
    ("mc-letter-dot-text", "Answer: C. 5", "C", 1.0, ABCD),
    ("mc-lowercase-letter", r"\boxed{c}", "C", 1.0, ABCD),
    ("mc-wrong-letter", r"\boxed{B}", "C", 0.0, ABCD),
    ("mc-text-for-letter", r"\boxed{5}", "C", 1.0, ABCD),
    ("mc-wrong-text-for-letter", r"\boxed{4}", "C", 0.0, ABCD),
    ("mc-letter-for-text", r"\boxed{C}", "5", 1.0, ABCD),
    ("mc-wrong-letter-for-text", r"\boxed{B}", "5", 0.0, ABCD),
    ("mc-letter-out-of-range", r"\boxed{E}", "C", 0.0, ABCD),
    ("mc-int-choices", r"\boxed{5}", "C", 1.0, [3, 4, 5, 6]),
    ("mc-equivalent-root", r"\boxed{\sqrt{12}}", "A", 1.0, ROOTS),
    ("mc-rounded-root", r"\boxed{3.46}", "A", 1.0, ROOTS),
    ("mc-rounded-wrong-root", r"\boxed{4.24}", "A", 0.0, ROOTS),
    ("mc-letter-for-root-text", r"\boxed{A}", r"2\sqrt{3}", 1.0, ROOTS),
    ("mc-degrees", r"\boxed{60^\circ}", "C", 1.0, ANGLES),
    ("mc-exact-choice-preferred", r"\boxed{1.73}", "B", 0.0, NEAR),
    ("mc-exact-choice-picked", r"\boxed{1.73}", "A", 1.0, NEAR),
    ("letter-no-choices", r"\boxed{B}", "B", 1.0, None),
    ("paren-letter-no-choices", "Answer: (B)", "B", 1.0, None),
    ("number-for-letter-no-choices", r"\boxed{12}", "B", 0.0, None),
    ("letter-for-number-no-choices", r"\boxed{B}", "12", 0.0, None),
    # --- malformed output
    ("empty", "", "12", 0.0, None),
    ("whitespace", "   \n ", "12", 0.0, None),
    ("unclosed-box", r"so the area is \boxed{12", "12", 0.0, None),
    ("empty-box", r"\boxed{}", "12", 0.0, None),
    ("empty-tags", "<answer></answer>", "12", 0.0, None),
    ("answer-line-empty", "Answer:", "12", 0.0, None),
    ("garbage", "asdf qwer zxcv", "12", 0.0, None),
    (
        "rambling-no-answer",
        "I think we need to look at the triangle more carefully before deciding.",
        "12",
        0.0,
        None,
    ),
    ("empty-fraction-part", r"\boxed{\frac{1}{}}", "1", 0.0, None),
    ("empty-root", r"\boxed{\sqrt{}}", "0", 0.0, None),
    ("bad-brackets", r"\boxed{)(}", "0", 0.0, None),
    ("division-by-zero", r"\boxed{1/0}", "0", 0.0, None),
    ("zero-over-zero", r"\boxed{0/0}", "0", 0.0, None),
    ("variable-for-number", r"\boxed{x}", "5", 0.0, None),
    ("variable-exponent", r"\boxed{2^{x}}", "4", 0.0, None),
    ("two-answers", r"\boxed{12 \text{ or } 13}", "12", 0.0, None),
    ("infinity", r"\boxed{\infty}", "12", 0.0, None),
    ("unknown-command", r"\boxed{\foo{12}}", "12", 0.0, None),
    ("none-truth", r"\boxed{12}", None, 0.0, None),
]

# Every case where math-verify (`verify(parse(boxed truth), parse(response))`) scores differently from
# the geometry grader, and why. On this table math-verify never accepts what the grader rejects: each
# entry is an answer the grader accepts by a rule in its module docstring. The agreement test fails on a
# disagreement missing from here and on a listed one that is gone.
MATH_VERIFY_DISAGREEMENTS: dict[str, str] = {
    # Extraction: math-verify has no notion of <answer> tags or of the last box being the final one.
    "answer-tag": "math-verify ignores <answer> tags and takes a number from the reasoning (4)",
    "last-box-wins": "math-verify reads both boxes as the set {10, 12}; the grader takes the last box",
    "sqrt-plain-text": "math-verify reads `2sqrt(3)` as 2; the grader reads plain-text sqrt",
    "pi-plain-text": "math-verify reads `6pi` as 6; the grader reads plain-text pi",
    "sqrt-unicode": "math-verify leaves `2√3` as an unparsed string",
    # Rounding: math-verify compares numbers to 6 significant places; the grader accepts a decimal that
    # rounds from the exact value to the places written (truth side) or with >= 3 significant digits.
    "frac-sqrt-vs-rounded": "rounded truth 0.866 accepts sqrt(3)/2 = 0.86603",
    "frac-vs-rounded-truth": "rounded truth 0.67 accepts 2/3",
    "rounded-answer-3-digits": "0.667 is 2/3 rounded to 3 significant digits",
    "third-rounded": "0.333 is 1/3 rounded to 3 significant digits",
    "sqrt-rounded-3": "1.732 is sqrt(3) rounded",
    "sqrt-rounded-2": "1.73 is sqrt(3) rounded to 3 significant digits",
    "sqrt-vs-rounded-truth": "rounded truth 5.66 accepts 4 sqrt(2) = 5.657",
    "sqrt-vs-truth-1-place": "rounded truth 11.3 accepts 8 sqrt(2) = 11.31",
    "more-places-than-truth": "rounded truth 11.3 accepts the more precise 11.31",
    "sqrt-rounded-4-digits": "7.071 is 5 sqrt(2) rounded",
    "pi-rounded": "18.85 is 6 pi rounded",
    "pi-vs-rounded-truth": "rounded truth 18.85 accepts 6 pi",
    "pi-area-rounded": "113.1 is 36 pi rounded",
    "pi-area-vs-rounded-truth": "rounded truth 113.1 accepts 36 pi",
    "pi-3.14": "3.14 is pi rounded to 3 significant digits",
    "pi-times-rounded": "28.27 is 9 pi rounded",
    "percent-rounded": "33.3% is 1/3 rounded, read as 0.333",
    "approx-label": "both read 3.46, which the grader accepts as 2 sqrt(3) rounded",
    "approx-only": "both read 3.46, which the grader accepts as 2 sqrt(3) rounded",
    # Degrees and units: the grader drops them; math-verify keeps some as unparsed text or variables.
    "deg-sign": "math-verify keeps `60°` as a string",
    "deg-command": r"math-verify keeps `60\degree` as a string",
    "deg-in-truth": "math-verify keeps the truth `60°` as a string",
    "deg-to-radians": "the grader reads a degree sign as also meaning x pi/180 radians",
    "radians-for-degree-sign": "the same rule from the truth's side: 60° is also pi/3",
    "unit-units-squared": "math-verify reads `units^2` as variables u n i t s^2",
    "unit-units-superscript": "math-verify keeps `units²` as a string",
    "unit-cm2": "math-verify reads `cm^2` as variables c m^2",
    "word-answer": "the grader compares words case-insensitively; math-verify reads `Isosceles` as variables",
    # Multiple choice: math-verify does not see the choices column, and does not read `(C)` or `C.` after
    # "Answer:" as a letter.
    "mc-paren-letter": "math-verify extracts nothing from `Answer: (C)`",
    "mc-letter-period": "math-verify extracts nothing from `Answer: C.`",
    "mc-bare-letter": "math-verify extracts nothing from a bare `C`",
    "mc-answer-is-letter": "math-verify extracts nothing from `the answer is (C).`",
    "mc-option-word": "math-verify extracts nothing from `Option C`",
    "mc-letter-and-text": "math-verify reads `(C) 5` as 5 and compares it with the letter",
    "mc-letter-dot-text": "math-verify reads `C. 5` as 5 and compares it with the letter",
    "mc-text-for-letter": "choice text 5 is option C; math-verify has no choices",
    "mc-letter-for-text": "letter C is choice 5; math-verify has no choices",
    "mc-int-choices": "choice text 5 is option C; math-verify has no choices",
    "mc-equivalent-root": "sqrt(12) is choice A (2 sqrt(3)); math-verify has no choices",
    "mc-rounded-root": "3.46 is choice A (2 sqrt(3)) rounded; math-verify has no choices",
    "mc-letter-for-root-text": "letter A is choice 2 sqrt(3); math-verify has no choices",
    "mc-degrees": "60° is choice C; math-verify has no choices",
    "mc-exact-choice-picked": "1.73 is choice A; math-verify has no choices",
    "paren-letter-no-choices": "math-verify extracts nothing from `Answer: (B)`",
}


def _sample(response: str, ground_truth: object, choices: list[object] | None = None) -> RewardInput:
    return RewardInput(
        response=response, ground_truth=ground_truth, extra={"choices": choices} if choices else {}
    )


@pytest.mark.parametrize(
    ("response", "ground_truth", "expected", "choices"),
    [pytest.param(*case[1:], id=case[0]) for case in CASES],
)
def test_geometry_cases(
    response: str, ground_truth: object, expected: float, choices: list[object] | None
) -> None:
    assert geometry(_sample(response, ground_truth, choices)) == expected


def test_case_table_is_large_and_balanced() -> None:
    ids = [case[0] for case in CASES]
    assert len(ids) == len(set(ids)), "case ids must be unique"
    assert len(CASES) >= 150
    assert sum(case[3] == 0.0 for case in CASES) >= 50


def test_registered_and_usable_from_manager() -> None:
    assert GRADERS["geometry"] is geometry
    manager = RewardManager([{"name": "geometry", "kwargs": {"rel_tol": 1e-4}}])
    result = manager.score([_sample(r"\boxed{2\sqrt{3}}", r"\sqrt{12}"), _sample(r"\boxed{3}", "4")])
    assert result.overall == [1.0, 0.0]
    assert not result.failures


def test_whole_numbers_match_only_exactly() -> None:
    # 1e-4 relative tolerance would let 123457 pass for 123456; a count or length off by one is wrong.
    assert geometry(_sample(r"\boxed{123457}", "123456")) == 0.0
    assert geometry(_sample(r"\boxed{123456.0}", "123456")) == 1.0
    assert geometry(_sample(r"\boxed{12,000}", "12000")) == 1.0


def test_rel_tol_is_configurable() -> None:
    sample = _sample(r"\boxed{100.5}", "100")
    assert geometry(sample) == 0.0
    assert geometry(sample, rel_tol=1e-2) == 1.0


@pytest.mark.parametrize(
    ("response", "ground_truth", "choices"),
    [
        (None, "12", None),
        (r"\boxed{12}", ["12"], None),
        (r"\boxed{12}", True, None),
        (r"\boxed{B}", "B", "ABCD"),
        (r"\boxed{B}", "B", [None, {}, 3]),
        (r"\boxed{A}", "A", []),
    ],
)
def test_never_raises_on_odd_inputs(response: object, ground_truth: object, choices: object) -> None:
    sample = RewardInput(response=response, ground_truth=ground_truth, extra={"choices": choices})  # type: ignore[arg-type]
    assert geometry(sample) in (0.0, 1.0)


# --- adversarial output: refused quickly, never hangs ------------------------------------------------------

ADVERSARIAL: list[tuple[str, str]] = [
    ("power-tower", r"\boxed{9^{9^{9^9}}}"),
    ("python-power-tower", "10**10**10"),
    ("huge-power", r"\boxed{2^{1000}}"),
    ("power-of-power", r"\boxed{(10^{100})^{100}}"),
    ("tiny-power", r"\boxed{10^{-1000}}"),
    ("high-root", r"\boxed{\sqrt[1000000]{2}}"),
    ("symbol-tower", r"\boxed{x^{x^{x^{x}}}}"),
    ("factorial", r"\boxed{999999999!}"),
    ("factorial-chain", r"\boxed{10!!!!!!}"),
    ("sci-notation", r"\boxed{1e999999}"),
    ("long-sum", r"\boxed{" + "+".join(["1"] * 5000) + "}"),
    ("long-product", r"\boxed{" + r"\sqrt{2}" * 1500 + "}"),
    ("deep-brackets", r"\boxed{" + "(" * 5000 + "1" + ")" * 5000 + "}"),
    ("deep-fractions", r"\boxed{" + r"\frac{1}{" * 40 + "2" + "}" * 40 + "}"),
    ("long-number", r"\boxed{" + "9" * 100_000 + "}"),
    ("answer-just-too-long", "Answer: " + "1" * 300),
    ("unclosed-boxes", r"\boxed{" * 50_000),
    ("unclosed-tags", "<answer>" * 50_000),
    ("open-braces", r"\boxed{2}" + "{" * 200_000),
    ("whitespace-run", r"\boxed{1" + " " * 200 + "x}"),
    ("many-variables", r"\boxed{" + "".join(chr(c) for c in range(ord("a"), ord("z") + 1)) * 9 + "}"),
]


def _cpu_seconds(fn: Callable[[], object]) -> tuple[object, float]:
    """`fn()` and the CPU time this thread spent in it. CPU time, not wall time: on a loaded CI machine
    (two test workers, Ray, vLLM) wall time stretches several-fold while the work itself does not."""
    started = time.thread_time()
    result = fn()
    return result, time.thread_time() - started


@pytest.fixture(scope="module")
def warm_grader() -> None:
    """Grade once so sympy's import and first use (about 1 s) are not charged to the case timed first."""
    assert geometry(_sample(r"\boxed{x^2 + \sqrt{2}}", "1")) == 0.0


@pytest.mark.parametrize("response", [pytest.param(r, id=i) for i, r in ADVERSARIAL])
def test_adversarial_scores_zero_quickly(response: str, warm_grader: None) -> None:
    # A deadline far off, so a case the bounds miss hangs the test rather than being cut off at 1 s.
    score, seconds = _cpu_seconds(lambda: geometry(_sample(response, "1"), timeout_s=60.0))
    assert score == 0.0
    assert seconds < 1.0, (
        "refused by the bounds within the 1 s deadline that backs them up (the worst case takes 0.16 s)"
    )


def test_long_response_with_answer_at_the_end(warm_grader: None) -> None:
    response = "Let us reason. " * 70_000 + r"So $\boxed{2\sqrt{3}}$."
    score, seconds = _cpu_seconds(lambda: geometry(_sample(response, r"\sqrt{12}")))
    assert score == 1.0
    assert seconds < 0.5


# --- extraction added for this grader -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "bare_max_chars", "expected"),
    [
        ("So the answer is 12 cm.", 0, "12 cm."),
        ("The answer is: (B)", 0, "(B)"),
        ("B", 0, None),
        ("B", 40, "B"),
        ("  12 cm \n", 40, "12 cm"),
        ("12\ncm", 40, None),
        ("x" * 41, 40, None),
        (r"\boxed{1} \boxed{\boxed{2}} \boxed{3", 0, r"\boxed{2}"),
        (r"\boxed{a\}b} \boxed{c}", 0, "c"),
        ("<answer>a<answer>b</answer> <answer>c", 0, "a<answer>b"),
    ],
)
def test_extract_answer_extensions(text: str, bare_max_chars: int, expected: str | None) -> None:
    assert extract_answer(text, bare_max_chars=bare_max_chars) == expected


@pytest.mark.parametrize(
    "text",
    [r"\boxed{" * 100_000, "<answer>" * 100_000, "{" * 500_000, r"\boxed{" + "\\" * 500_000],
)
def test_extract_answer_is_linear(text: str) -> None:
    assert _cpu_seconds(lambda: extract_answer(text))[1] < 0.5


# --- deadline ----------------------------------------------------------------------------------------------


def test_deadline_interrupts_slow_work() -> None:
    handler = signal.getsignal(signal.SIGALRM)
    started = time.perf_counter()
    with pytest.raises(deadline_module.Timeout), deadline_module.deadline(0.05):
        while True:
            pass
    assert time.perf_counter() - started < 1.0
    assert signal.getsignal(signal.SIGALRM) is handler


def test_timeout_scores_zero_and_is_not_cached(monkeypatch: pytest.MonkeyPatch) -> None:
    evaluate = geometry_module._evaluate

    def stuck(expr: object) -> object:
        time.sleep(5)
        return evaluate(expr)  # type: ignore[arg-type]

    monkeypatch.setattr(geometry_module, "_evaluate", stuck)
    sample = _sample(r"\boxed{7\sqrt{7}}", r"\sqrt{343}")
    started = time.perf_counter()
    assert geometry(sample, timeout_s=0.05) == 0.0
    assert time.perf_counter() - started < 1.0
    monkeypatch.setattr(geometry_module, "_evaluate", evaluate)
    assert geometry(sample) == 1.0


def test_deadline_keeps_an_outer_alarm() -> None:
    fired: list[int] = []

    def outer(signum: int, frame: FrameType | None) -> None:
        fired.append(signum)

    original = signal.signal(signal.SIGALRM, outer)
    try:
        signal.setitimer(signal.ITIMER_REAL, 0.3)
        assert geometry(_sample(r"\boxed{\frac{\sqrt{2}}{2}}", r"\frac{1}{\sqrt{2}}")) == 1.0
        assert signal.getsignal(signal.SIGALRM) is outer
        assert 0.0 < signal.getitimer(signal.ITIMER_REAL)[0] <= 0.3
        deadline = time.monotonic() + 2.0
        while not fired and time.monotonic() < deadline:
            time.sleep(0.01)
        assert fired == [signal.SIGALRM]
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, original)


def test_off_main_thread_uses_bounds_only() -> None:
    handler = signal.getsignal(signal.SIGALRM)
    samples = [_sample(r"\boxed{2\sqrt{3}}", r"\sqrt{12}"), _sample(r"\boxed{9^{9^{9^9}}}", "1")]
    with ThreadPoolExecutor(1) as pool:
        scores = list(pool.map(geometry, samples))
        worker_is_main = pool.submit(lambda: threading.current_thread() is threading.main_thread()).result()
    assert scores == [1.0, 0.0]
    assert not worker_is_main
    assert signal.getsignal(signal.SIGALRM) is handler


def test_ground_truth_parse_is_cached() -> None:
    truth = r"\frac{17}{\sqrt{19}}"
    geometry(_sample(r"\boxed{1}", truth))
    hits = geometry_module._parse.cache_info().hits
    for response in (r"\boxed{2}", r"\boxed{3}", r"\boxed{4}"):
        geometry(_sample(response, truth))
    assert geometry_module._parse.cache_info().hits >= hits + 3


# --- agreement with math-verify ----------------------------------------------------------------------------


def test_agreement_with_math_verify() -> None:
    from math_verify import parse, verify

    scored = [case for case in CASES if case[2] is not None]
    disagreements = {
        case_id: theirs
        for case_id, response, truth, _, choices in scored
        if (theirs := float(verify(parse(rf"\boxed{{{truth}}}"), parse(response))))
        != geometry(_sample(response, truth, choices))
    }
    assert sorted(disagreements) == sorted(MATH_VERIFY_DISAGREEMENTS), disagreements
    assert 1 - len(disagreements) / len(scored) >= 0.75  # measured: 153 of 202 cases agree (75.7%)
