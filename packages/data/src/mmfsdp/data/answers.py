"""Reading answers out of model completions and comparing them with ground truths: what the registered reward
functions (`mmfsdp.data.rewards`) are made of. Pure functions on strings.

- `extract_answer(text)`: the content of the last `<answer>...</answer>` if any, then of the last `\\boxed{...}` in
  that (balanced braces), else the text itself.
- `answers_equal(a, b)`: equal after normalisation (LaTeX spacing and sizing commands, `\\text{}`, `$`, a trailing
  period, case and whitespace dropped), or the same number (integers, decimals, `a/b`, `\\frac{a}{b}`, thousands
  separators: "0.5" == "1/2" == "\\frac{1}{2}", compared exactly as fractions), or the same expression by sympy
  (`simplify(a − b) == 0`) after a small LaTeX-to-sympy translation (`\\frac`, `\\sqrt`, `^`, `\\cdot`, `\\pi`, ...).
  The sympy parse is bounded: at most `MAX_EXPRESSION_CHARS` characters, and only a whitelist of tokens (numbers,
  operators, brackets, one-letter symbols, a few function names) reaches `parse_expr`, which evaluates its input —
  a completion is untrusted text. What sympy then computes is bounded in time by the reward's timeout (a worker
  process that is killed; `mmfsdp.data.rewards`), not here.
- `extract_choice(text)`: the letter of a multiple-choice answer ("B", "(B)", "B. cats", "the answer is B").
- `parse_box(value)` and `box_iou(a, b)`: a box in Qwen-VL's grounding formats (`(x1,y1),(x2,y2)`, inside
  `<|box_start|>...<|box_end|>` or not, and JSON `"bbox_2d": [x1, y1, x2, y2]`) or a list of four numbers, and the
  intersection over union of two boxes.
"""

from __future__ import annotations

import re
from fractions import Fraction
from typing import Any

__all__ = [
    "MAX_EXPRESSION_CHARS",
    "extract_answer",
    "normalise_answer",
    "parse_number",
    "answers_equal",
    "extract_choice",
    "parse_box",
    "box_iou",
]

MAX_EXPRESSION_CHARS = 200
"""Longer answers are compared as strings and numbers only, never parsed by sympy."""

_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)


def _braced(text: str, start: int) -> tuple[str, int] | None:
    """The content of the balanced `{...}` opening at `text[start]`, and the index after its `}`."""
    if start >= len(text) or text[start] != "{":
        return None
    depth = 0
    for index in range(start, len(text)):
        depth += {"{": 1, "}": -1}.get(text[index], 0)
        if depth == 0:
            return text[start + 1 : index], index + 1
    return None


_BOXED = re.compile(r"\\(?:boxed|fbox)\s*\{")


def _last_boxed(text: str) -> str | None:
    starts = list(_BOXED.finditer(text))
    found = _braced(text, starts[-1].end() - 1) if starts else None
    return found[0] if found else None


def extract_answer(text: str) -> str:
    """The answer part of a completion (module docstring)."""
    tagged = _ANSWER_TAG.findall(text)
    if tagged:
        text = tagged[-1]
    boxed = _last_boxed(text)
    return (boxed if boxed is not None else text).strip()


_DROPPED = re.compile(r"\\(?:left|right|displaystyle|!|,|;|:|quad|qquad)|\$|~|\\\(|\\\)|\\\[|\\\]")
_WRAPPERS = re.compile(r"\\(?:text|textbf|mathrm|mathbf|operatorname)\s*\{([^{}]*)\}")


def normalise_answer(text: str) -> str:
    """`text` without LaTeX spacing/sizing commands, text wrappers, `$`, a trailing period, whitespace; lower case;
    `\\dfrac` / `\\tfrac` spelled `\\frac`."""
    text = _WRAPPERS.sub(r"\1", text)
    text = _DROPPED.sub("", text)
    text = re.sub(r"\\[dt]frac", r"\\frac", text)
    text = re.sub(r"\s+", "", text).rstrip(".")
    return text.casefold()


_DECIMAL = r"[+-]?(?:\d+(?:\.\d*)?|\.\d+)(?:e[+-]?\d+)?"
_NUMBER = re.compile(_DECIMAL)
_RATIO = re.compile(rf"({_DECIMAL})/({_DECIMAL})")
_FRAC = re.compile(r"([+-]?)\\frac(?:\{([^{}]+)\}|(\d))(?:\{([^{}]+)\}|(\d))")
_THOUSANDS = re.compile(r"[+-]?\d{1,3}(?:,\d{3})+(?:\.\d+)?")


def parse_number(text: str) -> Fraction | None:
    """The exact value of a normalised number: `12`, `-0.5`, `1e-3`, `1,000`, `3/4`, `\\frac{3}{4}`, `\\frac34`,
    `50\\%` (as 50); None when `text` is not one."""
    text = normalise_answer(text).removesuffix("\\%").removesuffix("%")
    if _THOUSANDS.fullmatch(text):
        text = text.replace(",", "")
    try:
        if _NUMBER.fullmatch(text):
            return Fraction(text)
        if ratio := _RATIO.fullmatch(text):
            numerator, denominator = Fraction(ratio.group(1)), Fraction(ratio.group(2))
            return numerator / denominator if denominator else None
        if frac := _FRAC.fullmatch(text):
            sign, numerator, denominator = frac.group(1), frac.group(2) or frac.group(3), frac.group(4) or frac.group(5)
            value = parse_number(numerator), parse_number(denominator)
            if value[0] is None or not value[1]:
                return None
            return -value[0] / value[1] if sign == "-" else value[0] / value[1]
    except (ValueError, ZeroDivisionError, OverflowError):
        return None
    return None


_FUNCTIONS = {"sqrt", "pi", "sin", "cos", "tan", "log", "ln", "exp", "oo"}
_TOKEN = re.compile(r"\s*(?:(\d+(?:\.\d+)?)|([A-Za-z]+)|(\*\*|[-+*/(),]))")


def _latex_to_sympy(text: str) -> str | None:
    """A sympy expression string for a small LaTeX subset; None when anything outside the whitelist is left."""
    text = normalise_answer(text)
    for command, replacement in (("\\cdot", "*"), ("\\times", "*"), ("\\div", "/"), ("\\pi", " pi "),
                                 ("\\infty", " oo "), ("\\ln", " ln "), ("\\log", " log "), ("\\exp", " exp ")):
        text = text.replace(command, replacement)
    for name in ("sin", "cos", "tan"):
        text = text.replace(f"\\{name}", f" {name} ")
    out, index = [], 0
    while index < len(text):
        if text.startswith("\\frac", index) or text.startswith("\\sqrt", index):
            command = text[index + 1 : index + 5]
            index += 5
            degree = None
            if command == "sqrt" and text.startswith("[", index):
                close = text.find("]", index)
                if close < 0:
                    return None
                degree, index = text[index + 1 : close], close + 1
            parts = []
            for _ in range(2 if command == "frac" else 1):
                found = _braced(text, index)
                if found is None:
                    if index < len(text) and text[index].isalnum():
                        found = (text[index], index + 1)
                    else:
                        return None
                inner = _latex_to_sympy(found[0])
                if inner is None:
                    return None
                parts.append(inner)
                index = found[1]
            if command == "frac":
                out.append(f"(({parts[0]})/({parts[1]}))")
            elif degree is not None:
                root = _latex_to_sympy(degree)
                if root is None:
                    return None
                out.append(f"(({parts[0]})**(1/({root})))")
            else:
                out.append(f"sqrt({parts[0]})")
        elif text[index] == "^":
            out.append("**")
            index += 1
        elif text[index] in "{}":
            out.append("(" if text[index] == "{" else ")")
            index += 1
        elif text[index] == "\\":
            return None
        else:
            out.append(text[index])
            index += 1
    expression = "".join(out)
    position = 0
    while position < len(expression):
        token = _TOKEN.match(expression, position)
        if token is None or token.end() == position:
            if expression[position:].strip() == "":
                break
            return None
        name = token.group(2)
        if name is not None and len(name) > 1 and name not in _FUNCTIONS:
            return None
        position = token.end()
    return expression


def _sympy_equal(a: str, b: str) -> bool:
    if max(len(a), len(b)) > MAX_EXPRESSION_CHARS:
        return False
    left, right = _latex_to_sympy(a), _latex_to_sympy(b)
    if not left or not right:
        return False
    import sympy
    from sympy.parsing.sympy_parser import implicit_multiplication, parse_expr, standard_transformations

    transformations = (*standard_transformations, implicit_multiplication)
    names = {"ln": sympy.log, "oo": sympy.oo, "pi": sympy.pi}
    try:
        x, y = (parse_expr(side, local_dict=dict(names), transformations=transformations) for side in (left, right))
        if isinstance(x, tuple) or isinstance(y, tuple):
            return False
        return bool(sympy.simplify(x - y) == 0)
    except Exception:  # sympy raises many kinds on odd input: then the answers are not shown equal
        return False


def answers_equal(answer: str, ground_truth: str) -> bool:
    """Whether `answer` and `ground_truth` (each already extracted) say the same (module docstring)."""
    a, b = normalise_answer(answer), normalise_answer(ground_truth)
    if not a or not b:
        return False
    if a == b:
        return True
    x, y = parse_number(a), parse_number(b)
    if x is not None and y is not None:
        return x == y
    return _sympy_equal(answer, ground_truth)


_CHOICE_PATTERNS = (
    re.compile(r"^(?:\(([A-Z])\)|([A-Z])(?:[.:)]|$))"),
    re.compile(r"(?i:answer|option|choice)\s*(?i:is)?\s*:?\s*\(?([A-Z])\)?(?![A-Za-z])"),
    re.compile(r"\(([A-Z])\)"),
)


def extract_choice(text: str) -> str | None:
    """The chosen letter: opening the answer ("B", "(B)", "B. cats", "B) cats"), after "answer is" / "answer:" (the
    last such), in parentheses (the last), or the only standalone capital letter; None when there is none."""
    answer = extract_answer(text)
    if found := _CHOICE_PATTERNS[0].match(answer):
        return found.group(1) or found.group(2)
    for pattern in _CHOICE_PATTERNS[1:]:
        matches = pattern.findall(answer)
        if matches:
            return matches[-1]
    letters = set(re.findall(r"(?<![A-Za-z'])([A-Z])(?![A-Za-z'])", answer))
    return letters.pop() if len(letters) == 1 else None


_NUM = r"\s*([+-]?\d+(?:\.\d+)?)\s*"
_BBOX_2D = re.compile(rf'"?bbox_2d"?\s*:\s*\[{_NUM},{_NUM},{_NUM},{_NUM}\]')
_CORNERS = re.compile(rf"\({_NUM},{_NUM}\)\s*,\s*\({_NUM},{_NUM}\)")


def parse_box(value: Any) -> tuple[float, float, float, float] | None:
    """`(x1, y1, x2, y2)` from four numbers, a `{"bbox_2d": [...]}` dict (or a list holding one first), or text in
    Qwen-VL's formats (the first box: `bbox_2d` before the corner pairs); None when there is none."""
    if isinstance(value, dict):
        value = value.get("bbox_2d")
    if isinstance(value, (list, tuple)) and value and isinstance(value[0], dict):
        value = value[0].get("bbox_2d")
    if isinstance(value, (list, tuple)):
        if len(value) == 4 and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in value):
            return tuple(float(v) for v in value)
        return None
    if not isinstance(value, str):
        return None
    for pattern in (_BBOX_2D, _CORNERS):
        if found := pattern.search(value):
            return tuple(float(v) for v in found.groups())
    return None


def box_iou(a: tuple[float, ...], b: tuple[float, ...]) -> float:
    """Intersection over union of two `(x1, y1, x2, y2)` boxes; 0 for boxes without area."""
    width = min(a[2], b[2]) - max(a[0], b[0])
    height = min(a[3], b[3]) - max(a[1], b[1])
    intersection = max(width, 0.0) * max(height, 0.0)
    area_a = max(a[2] - a[0], 0.0) * max(a[3] - a[1], 0.0)
    area_b = max(b[2] - b[0], 0.0) * max(b[3] - b[1], 0.0)
    union = area_a + area_b - intersection
    return intersection / union if union > 0 else 0.0
