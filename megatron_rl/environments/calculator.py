"""The `calculator(expression)` tool: arithmetic evaluated from its syntax tree, never with eval.

Allowed: int and float literals, + - * / // % ** (binary), unary + and -, parentheses. Nothing else parses into a
value: names, calls, attributes, subscripts, comparisons, strings, containers are refused with the construct named.
Bounds, so that model-written input can cost neither time nor memory:
- the expression's length and nesting depth (Python's own parser recurses);
- integer results to MAX_INT_DIGITS decimal digits, checked BEFORE a power is computed (9**9**9 would take minutes
  in C, beyond any signal) and after every other operation (a product of two bounded ints is cheap to compute);
- exponents to MAX_EXPONENT in magnitude; float overflow, inf and nan, complex results and division by zero are
  errors, not values.
"""
from __future__ import annotations

import ast
import math
import operator

MAX_EXPRESSION_CHARS = 1000
MAX_DEPTH = 50
MAX_INT_DIGITS = 1000
MAX_EXPONENT = 10_000

_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}


class CalculatorError(ValueError):
    """The expression is not allowed arithmetic, or its value is out of bounds; the message says which."""


def calculator(expression: str) -> str:
    """The value of an arithmetic expression, as Python prints it ("7", "3.5", "-0.25"); CalculatorError if the
    expression is not allowed or its value is out of bounds."""
    if not isinstance(expression, str):
        raise CalculatorError(f"expression must be a string, got {type(expression).__name__}")
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise CalculatorError(f"expression longer than {MAX_EXPRESSION_CHARS} characters")
    if not expression.strip():
        raise CalculatorError("empty expression")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError) as e:
        # ValueError: an integer literal over Python's int-string limit; RecursionError/MemoryError: deep nesting
        raise CalculatorError(f"not an arithmetic expression ({type(e).__name__}: {getattr(e, 'msg', e)})") from None
    value = _eval(tree.body, 0)
    return _format(value)


def _eval(node: ast.AST, depth: int):
    if depth > MAX_DEPTH:
        raise CalculatorError(f"expression nested deeper than {MAX_DEPTH} levels")
    if isinstance(node, ast.Constant):
        v = node.value
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise CalculatorError(f"only numbers are allowed, not {v!r}")
        return _check(v)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _check(_UNARY[type(node.op)](_eval(node.operand, depth + 1)))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _eval(node.left, depth + 1), _eval(node.right, depth + 1)
        if isinstance(node.op, ast.Pow):
            _check_power(left, right)
        try:
            return _check(_BINARY[type(node.op)](left, right))
        except ZeroDivisionError:
            raise CalculatorError("division by zero") from None
        except OverflowError:
            raise CalculatorError("result too large") from None
    raise CalculatorError(f"{_construct(node)} is not allowed (only numbers, + - * / // % **, parentheses)")


def _check_power(base, exp) -> None:
    if abs(exp) > MAX_EXPONENT:
        raise CalculatorError(f"exponent {exp!r} larger than {MAX_EXPONENT} in magnitude")
    if isinstance(base, int) and isinstance(exp, int) and exp > 0 and abs(base) > 1:
        # digits of base**exp, from logarithms: the power itself is only computed when it is small enough
        digits = exp * math.log10(abs(base))
        if digits > MAX_INT_DIGITS:
            raise CalculatorError(f"result would have about {digits:.0f} digits, more than {MAX_INT_DIGITS}")


def _check(value):
    if isinstance(value, complex):
        raise CalculatorError("the result is not a real number")
    if isinstance(value, float) and not math.isfinite(value):
        raise CalculatorError("result is not finite")
    if isinstance(value, int) and value.bit_length() > MAX_INT_DIGITS * 3.33:  # 3.33 bits per decimal digit
        raise CalculatorError(f"result has more than {MAX_INT_DIGITS} digits")
    return value


def _format(value) -> str:
    return str(value) if isinstance(value, int) else repr(value)


def _construct(node: ast.AST) -> str:
    names = {ast.Name: "a name", ast.Call: "a function call", ast.Attribute: "an attribute",
             ast.Subscript: "a subscript", ast.Compare: "a comparison", ast.BoolOp: "a boolean operator",
             ast.Lambda: "a lambda", ast.IfExp: "a conditional"}
    for cls, text in names.items():
        if isinstance(node, cls):
            return text
    if isinstance(node, (ast.BinOp, ast.UnaryOp)):
        return f"the operator {type(node.op).__name__}"
    return type(node).__name__
