"""flexsarathi/formats/chat_template.py: a chat template that would build gigabytes (a repeat, a
power, a width handed to a method or a filter, a format string's field width, a loop writing a
message over and over) is refused with an error naming what it asked, before it is built: the
peak memory of a child process rendering them all stays within 100 MiB of its start (VmHWM). The
same operations at sizes a template really uses render as jinja2 itself renders them."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from flexsarathi.errors import FlexSarathiError
from flexsarathi.formats.chat_template import MAX_CHARS, compile_template, render
from tests.conftest import REPO

MESSAGES = [{"role": "user", "content": "hello " * 100}]
DOUBLING = ("{{% set ns = namespace(a='x' * 10000000) %}}{{% for i in range(40) %}}{{% set ns.a = {} %}}"
            "{{% endfor %}}{{{{ ns.a | length }}}}")
HOSTILE = [
    ("{{ 'x' * 10**10 }}", "repeats a str of 1 10,000,000,000 times"),
    ("{{ [0] * 10**9 }}", "repeats a list of 1 1,000,000,000 times"),
    ("{{ 10 ** (10 ** 9) }}", "raises 10 to the power 1,000,000,000"),
    ("{{ 'x'.ljust(10**10) }}", "passes 10,000,000,000 to a function"),
    ("{{ messages[0].content | indent(10**10) }}", "passes 10,000,000,000 to a function"),
    ("{{ messages[0].content | center(10**9) }}", "passes 1,000,000,000 to a function"),
    ("{{ messages | tojson(indent=10**9) }}", "passes 1,000,000,000 to a function"),
    ("{{ '%1000000000d' | format(1) }}", "passes 1,000,000,000 to a function"),
    ("{{ '{:>1000000000}'.format(1) }}", "passes 1,000,000,000 to a function"),
    ("{{ '{x:>1000000000}'.format_map({'x': 1}) }}", "passes 1,000,000,000 to a function"),
    ("{% for i in range(100000) %}{% for j in range(100000) %}{{ messages[0].content }}{% endfor %}{% endfor %}",
     f"writes more than {MAX_CHARS:,} characters"),
    # doubling a string in a loop, four ways: each would reach 2**40 x 10 MB
    (DOUBLING.format("ns.a ~ ns.a"), "joins 20,000,000 characters"),
    (DOUBLING.format("ns.a + ns.a"), "adds 10,000,000 and 10,000,000 items"),
    (DOUBLING.format("[ns.a, ns.a] | join"), "joins 20,000,000 characters"),
    (DOUBLING.format("''.join([ns.a, ns.a])"), "joins 20,000,000 characters"),
    ("{{ ('x' * 1000).replace('x', 'y' * 1000000) }}", "replaces into 1,000,000,000 characters"),
    ("{{ ('x' * 1000) | replace('x', 'y' * 1000000) }}", "replaces into 1,000,000,000 characters"),
]
BENIGN = ("{{ 'ab' * 3 }}|{{ 2 ** 10 }}|{{ 'x'.ljust(5) }}|{{ '%5d' | format(3) }}|{{ '{:>4}'.format(1) }}|"
          "{{ messages[0].content[:11] | indent(2, true) }}|{{ messages[0] | tojson(indent=2) | length }}|"
          "{% for m in messages * 2 %}{{ m.role }}{% endfor %}|{{ 'a' ~ 'b' }}|{{ [1] + [2] }}|"
          "{{ 'ab'.replace('a', 'c') }}|{{ 'ab' | replace('b', 'd') }}|{{ ['a', 'b'] | join('-') }}|{{ '-'.join(['x', 'y']) }}")


@pytest.mark.parametrize("source, message", HOSTILE, ids=[h[1][:30] for h in HOSTILE])
def test_a_template_that_would_build_gigabytes_is_refused(source, message):
    with pytest.raises(FlexSarathiError, match=f"^the chat template {message}"):
        render(compile_template(source), {"messages": MESSAGES})


def test_refused_before_it_is_built():
    child = ("import json, sys; from flexsarathi.formats.chat_template import compile_template, render\n"
             "from flexsarathi.errors import FlexSarathiError\n"
             "def hwm(): return int(next(l for l in open('/proc/self/status') if l.startswith('VmHWM')).split()[1])\n"
             "before = hwm()\n"
             "for source in json.loads(sys.argv[1]):\n"
             "    try:\n        render(compile_template(source), {'messages': [{'content': 'hello ' * 100}]})\n"
             "    except FlexSarathiError:\n        pass\n"
             "print(hwm() - before)")
    grown_kib = int(subprocess.run([sys.executable, "-c", child, json.dumps([s for s, _ in HOSTILE])], cwd=REPO,
                                   capture_output=True, text=True, check=True, timeout=120).stdout)
    assert grown_kib < 100 * 1024, f"refusing them grew the peak by {grown_kib} KiB"


def test_what_templates_really_do_renders_as_jinja2_renders_it():
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    plain = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    plain.filters["tojson"] = lambda value, indent=None: json.dumps(value, ensure_ascii=False, indent=indent)
    expected = plain.from_string(BENIGN).render(messages=MESSAGES)
    assert render(compile_template(BENIGN), {"messages": MESSAGES}) == expected
    assert expected.startswith("ababab|1024|x    |    3|   1|  hello hello|")


def test_transformers_template_globals_render_as_transformers_renders_them():
    """Loop controls, strftime_now and tojson's options: what real templates use (Llama 3.x's date,
    gpt-oss's, compact tool schemas)."""
    from datetime import datetime

    from transformers.utils.chat_template_utils import _compile_jinja_template

    source = ("{% for m in messages %}{% if loop.index > 2 %}{% break %}{% endif %}{% if m.skip %}{% continue %}"
              "{% endif %}{{ m.content }};{% endfor %}{{ strftime_now('%Y-%m') }}|"
              "{{ messages | tojson(separators=(',', ':'), sort_keys=true) }}|{{ 'é' | tojson(ensure_ascii=true) }}")
    messages = [{"content": "a", "skip": False}, {"content": "b", "skip": True}, {"content": "c", "skip": False}]
    ours = render(compile_template(source), {"messages": messages})
    assert ours == _compile_jinja_template(source).render(messages=messages)
    assert ours.startswith(f"a;{datetime.now():%Y-%m}|[{{\"content\":\"a\",\"skip\":false}}")


def test_a_template_that_is_not_jinja2_is_named():
    with pytest.raises(FlexSarathiError, match="^chat_template is not valid jinja2"):
        compile_template("{% for %}", "chat_template")
