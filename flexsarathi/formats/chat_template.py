"""Chat templates (jinja2, as transformers renders them) in a sandbox that also bounds what a template
can make: jinja's sandbox keeps a template from Python's internals and caps `range`, but not
`'x' * 10**10` (10 GB built before anything is written), `10 ** 10 ** 9` (a power that never ends),
`'x'.ljust(10**10)`, a loop writing a message a million times, or a string doubled in a loop
(`~`, `+`, join: terabytes in 40 steps). Here every string or list a `*` or `+` would make, every
concatenation, join and replace, every power, every number handed to a function (a width, a count)
and the rendered text itself are held to MAX_CHARS (the text as it is written); a template past it
is refused with an error saying so. (A loop that writes nothing can still spin for a while: range's cap,
100,000 per loop, bounds it.)
"""
from __future__ import annotations

import functools
import json
import re
from datetime import datetime

from flexsarathi.errors import FlexSarathiError

# Most characters a rendered chat may hold: far beyond any context (a million tokens of about four
# characters), far below what would exhaust a machine's memory.
MAX_CHARS = 16 << 20
MAX_EXPONENT = 4096  # a power's largest exponent (2 ** 4096 has 1,234 digits)


def compile_template(source: str, what: str = "the checkpoint's chat template"):
    """The jinja2 template compiled in the bounded sandbox; FlexSarathiError where it is not jinja2."""
    from jinja2 import TemplateError

    env = _environment()
    try:
        return env.from_string(source)
    except TemplateError as exc:
        raise FlexSarathiError(f"{what} is not valid jinja2: {exc}") from None


def render(template, variables: dict, max_chars: int = MAX_CHARS) -> str:
    """The template rendered with `variables`, written piece by piece and refused past max_chars."""
    pieces, size = [], 0
    for piece in template.generate(**variables):
        size += len(piece)
        if size > max_chars:
            raise FlexSarathiError(f"the chat template writes more than {max_chars:,} characters for these "
                                   "messages: refused")
        pieces.append(piece)
    return "".join(pieces)


def _environment():
    from jinja2.compiler import CodeGenerator
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class BoundedCodeGenerator(CodeGenerator):
        def visit_Concat(self, node, frame):
            """`a ~ b` checked once made: each string a template holds is within MAX_CHARS, so a
            concatenation of k parts is within k x MAX_CHARS, and doubling in a loop stops at once."""
            self.write("environment.bounded(")
            super().visit_Concat(node, frame)
            self.write(")")

    class BoundedSandbox(ImmutableSandboxedEnvironment):
        intercepted_binops = frozenset(["*", "**", "+"])
        code_generator_class = BoundedCodeGenerator

        def call_binop(self, context, operator, left, right):
            _check_binop(operator, left, right)
            return super().call_binop(context, operator, left, right)

        def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 (jinja's own signature)
            # str.format reaches here wrapped by the sandbox's own formatter (the method is __wrapped__)
            method = getattr(__obj, "__wrapped__", __obj)
            name, owner = getattr(method, "__name__", ""), getattr(method, "__self__", None)
            _check_arguments(args, kwargs, owner if name in _FORMATTERS and isinstance(owner, str) else None)
            if isinstance(owner, str):
                _check_str_method(name, owner, args)
            return super().call(__context, __obj, *args, **kwargs)

        @staticmethod
        def bounded(value):
            if len(value) > MAX_CHARS:
                raise FlexSarathiError(f"the chat template joins {len(value):,} characters: more than {MAX_CHARS:,}, "
                                       "refused")
            return value

    def raise_exception(message):
        raise FlexSarathiError(f"the chat template refused these messages: {message}")

    # as transformers' environment: loop controls ({% break %}), its globals and its tojson
    env = BoundedSandbox(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.filters["tojson"] = _tojson
    # Filters are called directly, not through call(): each one checked the same way (`indent`'s
    # width, `format`'s "%1000000000d").
    env.filters = {name: _bounded(name, f) for name, f in env.filters.items()}
    return env


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    """transformers' tojson: JSON as json.dumps writes it (no HTML escaping), its options too."""
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format):
    """Now, formatted: today's date in a system prompt (Llama 3.x's and gpt-oss's templates)."""
    return datetime.now().strftime(format)


_FORMATTERS = ("format", "format_map")  # str methods whose format string can ask for any width


def _bounded(name: str, function):
    @functools.wraps(function)  # keeps jinja's pass_context / pass_environment marks
    def checked(*args, **kwargs):
        # format's format string is its first argument; replace's and join's come after jinja's
        # evaluation context (their value, old and new strings; the parts)
        strings = [a for a in args if isinstance(a, str)]
        _check_arguments(args, kwargs, strings[0] if name == "format" and strings else None)
        if name == "replace" and len(strings) >= 3:
            _check_str_method("replace", strings[0], strings[1:3])
        if name == "join" and len(args) >= 2:
            args = (args[0], _joined_parts(list(args[1])), *args[2:])
        return function(*args, **kwargs)

    return checked


def _check_str_method(name: str, owner: str, args) -> None:
    """A str method whose result the arguments' sizes do not bound: replace (each match becomes the
    new text) and join (the parts)."""
    if name == "replace" and len(args) >= 2 and isinstance(args[0], str) and isinstance(args[1], str):
        matches = owner.count(args[0]) if args[0] else len(owner) + 1
        size = len(owner) + matches * (len(args[1]) - len(args[0]))
        if size > MAX_CHARS:
            raise FlexSarathiError(f"the chat template replaces into {size:,} characters: more than "
                                   f"{MAX_CHARS:,}, refused")
    if name == "join" and args and isinstance(args[0], (list, tuple)):
        _joined_parts(list(args[0]), len(owner))


def _joined_parts(parts: list, separator: int = 0) -> list:
    size = sum(len(p) if isinstance(p, str) else 0 for p in parts) + separator * max(len(parts) - 1, 0)
    if size > MAX_CHARS:
        raise FlexSarathiError(f"the chat template joins {size:,} characters: more than {MAX_CHARS:,}, refused")
    return parts


def _check_arguments(args, kwargs, format_string: str | None) -> None:
    """Refuse a number past MAX_CHARS handed to a function (a width, a count), or written in a
    format string (a field width)."""
    numbers = [v for v in (*args, *kwargs.values()) if _is_int(v)]
    if format_string is not None:
        numbers += [int(digits) for digits in re.findall(r"\d{8,}", format_string)]
    for value in numbers:
        if abs(value) > MAX_CHARS:
            raise FlexSarathiError(f"the chat template passes {value:,} to a function: more than "
                                   f"{MAX_CHARS:,}, refused")


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_binop(operator: str, left, right) -> None:
    if operator == "+":
        if isinstance(left, (str, list, tuple)) and isinstance(right, (str, list, tuple)) \
                and len(left) + len(right) > MAX_CHARS:
            raise FlexSarathiError(f"the chat template adds {len(left):,} and {len(right):,} items: more than "
                                   f"{MAX_CHARS:,}, refused")
        return
    if operator == "**":
        if _is_int(left) and _is_int(right) and abs(left) > 1 and right > MAX_EXPONENT:
            raise FlexSarathiError(f"the chat template raises {left} to the power {right:,}: refused "
                                   f"(at most {MAX_EXPONENT})")
        return
    for seq, count in ((left, right), (right, left)):
        if isinstance(seq, (str, list, tuple)) and _is_int(count) and len(seq) * count > MAX_CHARS:
            raise FlexSarathiError(f"the chat template repeats a {type(seq).__name__} of {len(seq):,} "
                                   f"{count:,} times: more than {MAX_CHARS:,} items, refused")
