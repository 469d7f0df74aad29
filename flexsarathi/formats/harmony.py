"""OpenAI's harmony format (gpt-oss): a reply is a run of messages on channels, read back into what
a chat completion holds, as vLLM serves gpt-oss: the `final` channel's text is the message's content,
the other messages' text its reasoning (`reasoning_content`), and a message addressed
`to=functions.NAME` a call of that function with the message as its arguments.

    <|channel|>analysis<|message|>The user asks ...<|end|>
    <|start|>assistant<|channel|>final<|message|>It is 20 C in Rome.<|return|>
    <|start|>assistant to=functions.get_weather<|channel|>commentary <|constrain|>json<|message|>{...}<|call|>

The reply continues the prompt's `<|start|>assistant`, so its first message has no role. The markers
are special tokens: a reply is read from its text decoded with special tokens kept. A model speaks
harmony where its chat template writes these markers.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field

from flexsarathi.formats.tool_calls import ToolCall

START, CHANNEL, MESSAGE = "<|start|>", "<|channel|>", "<|message|>"
_MESSAGE_ENDS = re.compile(r"<\|end\|>|<\|return\|>|<\|call\|>")
_RECIPIENT = re.compile(r"\bto=([^\s<]+)")  # up to a space or the next marker
_CONSTRAIN = "<|constrain|>"
FUNCTIONS = "functions."


def speaks_harmony(chat_template: str | None) -> bool:
    """Whether a chat template writes harmony's messages (gpt-oss's does)."""
    return bool(chat_template) and CHANNEL in chat_template and MESSAGE in chat_template


@dataclass(frozen=True)
class HarmonyReply:
    content: str | None  # the final channel's text (None: the reply has none, e.g. cut short while reasoning)
    reasoning: str | None  # the other messages' text, one per line
    calls: list[ToolCall] = field(default_factory=list)


def read_harmony(text_with_specials: str, read_calls: bool = True) -> HarmonyReply | None:
    """The reply's messages read back; None where the text is not harmony messages (then it is
    plain text, as the model wrote it). read_calls False: a message to a function is reasoning too
    (tool_choice "none")."""
    finals, others, calls = [], [], []
    for k, segment in enumerate(text_with_specials.split(START)):
        header, marker, rest = segment.partition(MESSAGE)
        if not marker:
            if k == 0:
                return None
            continue  # a header cut short by max_tokens: nothing of its message yet
        body = _MESSAGE_ENDS.split(rest, maxsplit=1)[0]
        channel = header.partition(CHANNEL)[2].partition(_CONSTRAIN)[0].split()
        recipient = _RECIPIENT.search(header)
        if read_calls and recipient is not None and recipient.group(1).startswith(FUNCTIONS):
            calls.append(ToolCall(recipient.group(1)[len(FUNCTIONS):], body))
        elif channel and channel[0] == "final":
            finals.append(body)
        else:
            others.append(body)
    others = [text for text in others if text]
    return HarmonyReply("".join(finals) if finals else None, "\n".join(others) if others else None, calls)
