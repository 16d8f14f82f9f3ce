"""Chat and instruction data for ``titan-lightning prepare``: each conversation rendered with the
checkpoint's own chat template into token ids and a loss mask (1 on what the assistant says).

The template is ``--chat-template FILE``, else the tokenizer folder's ``chat_template.jinja``, else
the ``chat_template`` of its ``tokenizer_config.json`` (a string, or a list of ``{"name",
"template"}``: the "default" one). It is rendered as transformers renders it (``trim_blocks``,
``lstrip_blocks``, ``raise_exception``, ``strftime_now``, ``tojson``, ``bos_token``, ``eos_token``,
``add_generation_prompt=False``), in Jinja2's immutable sandbox with no loader: a template from a
downloaded folder reaches neither Python objects nor files.

What the mask supervises, per assistant turn: with ``{% generation %}...{% endgeneration %}``
markers in the template, the text they enclose (one render per conversation). Without them, from
the end of the generation prompt (the conversation before the turn rendered with
``add_generation_prompt=True``: what the model is given at inference) through the first special
token after the turn's content (its end of turn: ``<|eot_id|>``, ``<|im_end|>``); the turn's own
text is found by rendering the prefixes before and up to it. A template that adds no generation
prompt (Mistral's ``[INST] ... [/INST] answer</s>``) gives the model the conversation before the
turn: all that follows is supervised, the space before the answer included (what TRL's
completion-only training after ``[/INST]`` supervises, and what {% generation %} markers around
the whole assistant turn would mark); where it renders the turns before this one otherwise on
their own (the system message moves to the last user turn), the span starts at the content, with
the whitespace before it. Character spans become token spans through the tokenizer's offsets (a
token is supervised when any of its characters is).

Tool definitions (a record's ``tools``: JSON-schema function objects, or a JSON string of them)
are the template's ``tools`` variable in every render of the conversation, as transformers'
``apply_chat_template(messages, tools=...)`` passes them; an assistant turn that only calls tools
(``tool_calls``, a null or no ``content``) is supervised as the template renders the calls.

An assistant turn with ``"weight": 0`` (OpenAI's fine-tuning format; ShareGPT's) is context, not
supervised; 1 or no weight: supervised as ``train_on`` says (``all`` supervises every token still).

ShareGPT conversations (``{"from", "value"}`` messages, as axolotl, LLaMA-Factory and Unsloth's
``standardize_sharegpt`` read them: from ``human`` / ``gpt`` / ``system`` / ``tool``) are read as
the ``{"role", "content"}`` messages they stand for (SHAREGPT_ROLES); their other keys stay.

Prompt/response pairs are a user turn and an assistant turn through the template; with one
prompt field, either may be a list of messages instead (TRL's conversational prompt-completion:
the prompt's messages then the completion's, only the completion's assistant turns supervised). A
tokenizer without a template gives plain text: the prompt, a blank line, the response and EOS (BOS
first when the tokenizer adds one), the mask on the response and EOS.
"""

import hashlib
import json
import math
import re
import time
import traceback
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any, Optional, Sequence

import jinja2
import numpy as np
from jinja2 import nodes
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment, safe_range

from titan_lightning.data.tokenizer import read_tokenizer_config, tokenizer_file

ROLES = ("system", "user", "assistant", "tool")
SHAREGPT_ROLES = {"system": "system", "human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
                  "tool": "tool"}  # ShareGPT's "from" -> role (function_call / observation: LLaMA-Factory's own)
TRAIN_ON = ("assistant", "last_assistant", "all")
TOO_LONG = ("truncate", "drop")
PLAIN_SEPARATOR = "\n\n"  # between prompt and response without a chat template; also joins prompt fields
_MARKER = re.compile(r"\{%-?\s*generation\s*-?%\}")
Span = tuple[int, int]
RENDER_SECONDS = 2.0  # one render of a conversation at most (a real template takes milliseconds)
RENDER_CHARS = 2**26  # characters one render writes at most


class BadRecord(ValueError):
    """A record that cannot be trained on; the reason (the caller names file and line)."""


class TemplateFailure(BadRecord):
    """The chat template failed on a record (its own error, or ``raise_exception``)."""


@dataclass(frozen=True, kw_only=True)
class ChatOptions:
    """What ``prepare`` reads as conversations, and what it trains on.

    ``messages_field``: records hold a list of ``{"role", "content"}`` messages, and the tool
    definitions in ``tools_field`` when they have it (None: never); else ``prompt_fields`` (joined
    by a blank line, empty ones left out) and ``response_field`` are one user and one assistant
    turn. ``template``: a chat template file instead of the tokenizer's."""

    messages_field: Optional[str] = None
    tools_field: Optional[str] = "tools"
    prompt_fields: tuple[str, ...] = ()
    response_field: Optional[str] = None
    template: Optional[str] = None
    train_on: str = "assistant"
    max_tokens: Optional[int] = None
    too_long: str = "drop"

    def __post_init__(self) -> None:
        if self.train_on not in TRAIN_ON:
            raise ValueError(f"--train-on={self.train_on!r}: expected {', '.join(TRAIN_ON)}")
        if self.too_long not in TOO_LONG:
            raise ValueError(f"--too-long={self.too_long!r}: expected {' or '.join(TOO_LONG)}")
        if self.max_tokens is not None and self.max_tokens < 2:
            raise ValueError(f"--max-tokens={self.max_tokens}: expected >= 2 (tokens per conversation at most)")
        pairs = bool(self.prompt_fields) or self.response_field is not None
        if self.messages_field is not None and pairs:
            raise ValueError("--chat reads a messages field; --prompt-field/--response-field read prompt/response "
                             "pairs: give one or the other")
        if self.messages_field is not None and self.tools_field == self.messages_field:
            raise ValueError(f"--tools-field {self.tools_field!r} is also --messages-field: name the field of the "
                             f"tool definitions")
        if self.messages_field is None and not (self.prompt_fields and self.response_field):
            raise ValueError("prompt/response pairs need both --prompt-field and --response-field "
                             f"(given: {', '.join(self.prompt_fields) or 'no prompt field'}, "
                             f"{self.response_field or 'no response field'})")

    @property
    def fields(self) -> list[str]:
        """The record fields (JSONL keys, Parquet columns) read."""
        return [self.messages_field] if self.messages_field else [*self.prompt_fields, self.response_field]

    @property
    def optional_fields(self) -> list[str]:
        """The fields read when a record (a Parquet file: its schema) has them: the tools'."""
        return [self.tools_field] if self.messages_field and self.tools_field else []

    @property
    def field_options(self) -> list[tuple[str, str, type]]:
        """(field, the option that names it, the type its value has) for each field read."""
        if self.messages_field:
            return [(self.messages_field, "--messages-field", list)]
        kind = (str, list) if len(self.prompt_fields) == 1 else str  # (one field: TRL's conversational form too)
        return [*((f, "--prompt-field", kind) for f in self.prompt_fields),
                (self.response_field, "--response-field", kind)]


@dataclass(frozen=True)
class ChatSpec:
    """ChatOptions resolved for a run: the template's text (None: plain prompt + response) and the
    time ``strftime_now`` renders (fixed for the run: every worker, and a resume, render one date)."""

    options: ChatOptions
    template: Optional[str]
    origin: str
    now: str

    def settings(self) -> dict[str, Any]:
        """What a resumed run must share with the interrupted one."""
        o = self.options
        return {"fields": o.fields, "messages": o.messages_field is not None, "tools": o.optional_fields,
                "train_on": o.train_on, "max_tokens": o.max_tokens, "too_long": o.too_long,
                "chat_template_sha256": self.template_sha256, "now": self.now}

    @property
    def template_sha256(self) -> Optional[str]:
        return hashlib.sha256(self.template.encode("utf-8")).hexdigest() if self.template is not None else None


def read_chat_template(tokenizer_path: Optional[str], override: Optional[str]) -> tuple[Optional[str], str]:
    """(the chat template's text, where it came from); (None, "") when there is none."""
    if override is not None:
        file = Path(override)
        if not file.is_file():
            raise ValueError(f"--chat-template {override!r}: no such file; give a Jinja chat template file")
        try:
            return file.read_text(encoding="utf-8"), f"--chat-template {override}"
        except (OSError, UnicodeDecodeError) as err:
            raise ValueError(f"--chat-template {override!r} cannot be read as UTF-8 text ({err})") from None
    if tokenizer_path is None:
        return None, ""
    folder = tokenizer_file(tokenizer_path).parent
    jinja = folder / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text(encoding="utf-8"), str(jinja)
    config_file = folder / "tokenizer_config.json"
    template = read_tokenizer_config(config_file, "--tokenizer").get("chat_template")
    if isinstance(template, list):  # named templates ("default", "tool_use", ...): the default one
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
        if template is None:
            raise ValueError(f"{config_file}: chat_template lists {', '.join(map(str, named))} and no 'default'; "
                             f"give the one to use with --chat-template FILE")
    if template is not None and not isinstance(template, str):
        raise ValueError(f"{config_file}: chat_template is a {type(template).__name__}, expected a string")
    return template, f"{config_file} chat_template" if template is not None else ""


def resolve(options: ChatOptions, tokenizer_path: Optional[str]) -> ChatSpec:
    """The spec of a run: its template (checked to compile) and the time it renders."""
    template, origin = read_chat_template(tokenizer_path, options.template)
    if template is None and options.messages_field is not None:
        where = f"--tokenizer {tokenizer_path!r}" if tokenizer_path else "the shipped tokenizer"
        raise ValueError(f"--chat: {where} has no chat template (no chat_template.jinja, no chat_template in "
                         f"tokenizer_config.json); give one with --chat-template FILE, or read prompt/response "
                         f"pairs with --prompt-field and --response-field")
    if template is not None:
        compile_template(template, origin)
    return ChatSpec(options, template, origin, datetime.now().isoformat(timespec="seconds"))


class RenderBound(Exception):
    """A render went over ``RENDER_SECONDS`` or ``RENDER_CHARS``."""


class _BoundedSandbox(ImmutableSandboxedEnvironment):
    """The sandbox with a bound on a render's time (checked at each call the template makes and
    every 1024 steps of a ``range`` loop: nested loops that never end) and size (a string or list
    multiplied past ``RENDER_CHARS``); ``arm`` starts the clock of a render (none: no bound)."""

    intercepted_binops = frozenset(["*", "**"])

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.deadline = math.inf
        self.globals["range"] = self._range

    def arm(self) -> None:
        self.deadline = time.monotonic() + RENDER_SECONDS

    def check_time(self) -> None:
        if time.monotonic() > self.deadline:
            raise RenderBound(f"it renders for over {RENDER_SECONDS:g} s (a loop that does not end?)")

    def _range(self, *args: int):
        for k, value in enumerate(safe_range(*args)):
            if k % 1024 == 1023:
                self.check_time()
            yield value

    def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 - Jinja's own signature
        __self.check_time()
        return super().call(__context, __obj, *args, **kwargs)

    def call_binop(self, context, operator: str, left, right):
        if operator == "*" and any(isinstance(a, (str, list, tuple)) for a in (left, right)):
            length, times = (len(left), right) if isinstance(left, (str, list, tuple)) else (len(right), left)
            if isinstance(times, int) and length * times > RENDER_CHARS:
                raise RenderBound(f"it makes a sequence of {length * times:,} items (over {RENDER_CHARS:,})")
        if operator == "**" and isinstance(right, (int, float)) and abs(right) > 1000:
            raise RenderBound(f"it raises to the power {right} (over 1000)")
        return super().call_binop(context, operator, left, right)


class GenerationSpans(Extension):
    """The ``{% generation %}`` tag (as transformers defines it): records the character span, in the
    output rendered so far, of the text it encloses."""

    tags = {"generation"}

    def __init__(self, environment) -> None:
        super().__init__(environment)
        self.blocks: Optional[list[str]] = None
        self.spans: Optional[list[Span]] = None

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.CallBlock(self.call_method("_record"), [], [], body).set_lineno(lineno)

    def _record(self, caller) -> str:
        text = caller()
        if self.blocks is not None:
            start = sum(map(len, self.blocks))
            self.spans.append((start, start + len(text)))
        return text


def compile_template(source: str, origin: str, now: Optional[str] = None):
    """The Jinja2 template of ``source`` in the sandbox; ValueError naming ``origin`` and the line
    on a syntax error."""
    def raise_exception(message: str):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(fmt: str) -> str:
        return (datetime.fromisoformat(now) if now else datetime.now()).strftime(fmt)

    env = _BoundedSandbox(trim_blocks=True, lstrip_blocks=True, extensions=[GenerationSpans, loopcontrols])
    env.filters["tojson"] = tojson
    env.globals.update(raise_exception=raise_exception, strftime_now=strftime_now)
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as err:
        raise ValueError(f"{origin}: line {err.lineno}: {err.message} (a Jinja syntax error)") from None


def _template_line(err: BaseException) -> Optional[int]:
    """The template line a render failed on (Jinja2 rewrites tracebacks to point into it)."""
    lines = [frame.lineno for frame in traceback.extract_tb(err.__traceback__) if frame.filename == "<template>"]
    return lines[-1] if lines else getattr(err, "lineno", None)


def _without_nulls(value: Any) -> Any:
    """``value`` with every object's null-valued keys left out, at every depth."""
    if isinstance(value, dict):
        return {k: _without_nulls(v) for k, v in value.items() if v is not None}
    return [_without_nulls(v) for v in value] if isinstance(value, list) else value


def conversation(messages: Any, field: str) -> list[dict[str, Any]]:
    """``messages`` (the value of the record's ``field``) checked to be a non-empty list of {role,
    content} messages; BadRecord naming what is wrong. A key set to null is a key not given: Parquet
    gives every message each key any message has, and templates test keys by their presence
    ('tool_calls' in message)."""
    if not isinstance(messages, list) or not messages:
        raise BadRecord(f"no conversation in {field!r} (a list of {{role, content}} messages)")
    messages = [sharegpt_message(m, k) for k, m in enumerate(messages)]
    for k, message in enumerate(messages):
        if not isinstance(message, dict):
            raise BadRecord(f"message {k} is a {type(message).__name__}, not a {{role, content}} object")
        if message.get("role") not in ROLES:
            raise BadRecord(f"message {k}: unknown role {message.get('role')!r}; roles: {', '.join(ROLES)}")
        content = message.get("content")
        calls_tools = (content is None and message["role"] == "assistant"
                       and isinstance(message.get("tool_calls"), list) and bool(message["tool_calls"]))
        if not isinstance(content, str) and not calls_tools:
            raise BadRecord(f"message {k} ({message['role']}): content is "
                            f"{type(message.get('content')).__name__}, not a string")
        weight = message.get("weight")
        if weight is not None and (isinstance(weight, str) or weight not in (0, 1)):
            raise BadRecord(f"message {k}: weight {weight!r}; a turn's weight is 0 (not trained on) or 1")
    return [{k: v for k, v in m.items() if v is not None} for m in messages]


def sharegpt_message(message: Any, k: int) -> Any:
    """A ShareGPT message (``from`` and ``value``, no ``role``) as the {role, content} message it
    stands for, its other keys kept; any other message as it is. BadRecord for a ``from`` that is no
    ShareGPT role."""
    if not isinstance(message, dict) or message.get("role") is not None or message.get("from") is None:
        return message
    rest = {key: v for key, v in message.items() if key not in ("from", "value", "role")}
    if message["from"] not in SHAREGPT_ROLES:
        raise BadRecord(f"message {k}: unknown ShareGPT role (from) {message['from']!r}; ShareGPT roles: "
                        f"{', '.join(SHAREGPT_ROLES)}")
    return {"role": SHAREGPT_ROLES[message["from"]], "content": message.get("value"), **rest}


def token_mask(encoding, spans: Sequence[Span]) -> np.ndarray:
    """1 on each token with a character in one of ``spans``: found from each span's first and last
    character (``char_to_token``), not from every token's offsets."""
    n = len(encoding.ids)
    mask = np.zeros(n, dtype=np.uint8)
    for a, b in spans:
        if b <= a:
            continue
        first, last = encoding.char_to_token(a), encoding.char_to_token(b - 1)
        if first is None or last is None:  # a character no token covers (trimmed offsets): every token's
            return offsets_mask(encoding.offsets, spans)
        while last + 1 < n and encoding.token_to_chars(last + 1)[0] < b:  # tokens that start inside
            last += 1
        mask[first:last + 1] = 1
    return mask


def offsets_mask(offsets: Sequence[Span], spans: Sequence[Span]) -> np.ndarray:
    """1 on each token whose characters ``offsets`` meet one of ``spans`` (an empty one: by its start)."""
    of = np.asarray(offsets, dtype=np.int64).reshape(-1, 2)
    starts, ends = of[:, 0], np.maximum(of[:, 1], of[:, 0] + 1)
    mask = np.zeros(len(of), dtype=np.uint8)
    for a, b in spans:
        mask[(starts < b) & (ends > a)] = 1
    return mask


class ChatRenderer:
    """Records to (text, supervised character spans) to (ids, mask), for one ChatSpec and tokenizer."""

    def __init__(self, spec: ChatSpec, tokenizer) -> None:
        self.spec, self.options, self.tokenizer = spec, spec.options, tokenizer
        self.template = compile_template(spec.template, spec.origin, spec.now) if spec.template is not None else None
        self.markers = bool(_MARKER.search(spec.template or ""))
        if self.template is not None:
            self._spans = next(e for e in self.template.environment.extensions.values()
                               if isinstance(e, GenerationSpans))
        self._variables = {k: v for k, v in (("bos_token", tokenizer.bos_token), ("eos_token", tokenizer.eot_token))
                           if v is not None}
        specials = sorted(tokenizer.special_tokens(), key=len, reverse=True)
        self._special = re.compile("|".join(map(re.escape, specials))) if specials else None
        self._generation_prompt, self._end_of_turn = self._probe() if self.template is not None else (False, None)

    def _probe(self) -> tuple[Optional[bool], Optional["re.Pattern"]]:
        """What the template does, seen once on a two-turn conversation: does it add a generation
        prompt, and which special token ends an assistant turn (the first after its content)? Without
        an answer (the template fails on the probe, or ends a turn with no special token), each
        turn is also bounded by rendering the conversation up to it, and its prompt checked."""
        probe = [{"role": "user", "content": "Hi."}, {"role": "assistant", "content": "Hello."}]
        try:
            text, prompt = self._render(probe), self._render(probe[:1], generation_prompt=True)
            adds_prompt = prompt != self._render(probe[:1])
        except TemplateFailure:
            return None, None
        at = text.find("Hello.", len(prompt) if adds_prompt and text.startswith(prompt) else 0)
        end = self._special.search(text, at + len("Hello.")) if self._special is not None and at >= 0 else None
        return adds_prompt, re.compile(re.escape(end.group())) if end else None

    def messages(self, record: Any) -> list[dict[str, Any]]:
        """The conversation a record holds; BadRecord when it holds none to train on."""
        return self.conversation(record)[0]

    def conversation(self, record: Any) -> tuple[list[dict[str, Any]], int]:
        """(the conversation a record holds, how many of its first assistant turns are a
        prompt's: not supervised); BadRecord when it holds none to train on."""
        o = self.options
        if not isinstance(record, dict):
            raise BadRecord(f"not an object but a {type(record).__name__}")
        if o.messages_field is None:
            return self._pair(record)
        messages = conversation(record.get(o.messages_field), o.messages_field)
        if not any(m["role"] == "assistant" for m in messages):
            raise BadRecord("no assistant turn")
        return messages, 0

    def tools(self, record: Any) -> Optional[list]:
        """The tool definitions a record holds (None: it has none); BadRecord when they are not a
        list of objects, or a JSON string of one. A key set to null is a key not given, at every
        depth: Parquet gives each struct every key any row's has."""
        name = self.options.tools_field
        if name is None or self.options.messages_field is None or not isinstance(record, dict):
            return None
        tools, text = record.get(name), ""
        if isinstance(tools, str):
            try:
                tools, text = json.loads(tools), "a JSON string of "
            except ValueError:
                raise BadRecord(f"{name!r} is a string that is not JSON, not a list of tool objects") from None
        elif tools is None:
            return None
        if not isinstance(tools, list):
            raise BadRecord(f"{name!r} is {text}a {type(tools).__name__}, not a list of tool objects")
        for k, tool in enumerate(tools):
            if not isinstance(tool, dict):
                raise BadRecord(f"{name!r}: tool {k} is a {type(tool).__name__}, not an object")
        return _without_nulls(tools)

    def _pair(self, record: dict) -> tuple[list[dict[str, Any]], int]:
        o = self.options
        if any(isinstance(record.get(name), list) for name in (*o.prompt_fields, o.response_field)):
            return self._conversational_pair(record)
        parts = []
        for name in (*o.prompt_fields, o.response_field):
            value = record.get(name)
            if value is not None and not isinstance(value, str):
                raise BadRecord(f"{name!r} is a {type(value).__name__}, not a string")
            parts.append(value or "")
        prompt = PLAIN_SEPARATOR.join(p for p in parts[:-1] if p.strip())
        if not parts[0].strip():
            raise BadRecord(f"no text in {o.prompt_fields[0]!r}")
        if not parts[-1].strip():
            raise BadRecord(f"no text in {o.response_field!r}")
        return [{"role": "user", "content": prompt}, {"role": "assistant", "content": parts[-1]}], 0

    def _conversational_pair(self, record: dict) -> tuple[list[dict[str, Any]], int]:
        """TRL's conversational prompt-completion: the prompt's messages then the completion's (a
        text stands for one user / assistant turn), only the completion's assistant turns supervised."""
        o = self.options
        if len(o.prompt_fields) > 1:
            listed = next(n for n in (*o.prompt_fields, o.response_field) if isinstance(record.get(n), list))
            raise BadRecord(f"{listed!r} is a list of messages: a conversational prompt is one field, not "
                            f"{len(o.prompt_fields)} (--prompt-field)")
        if self.template is None:
            raise BadRecord("a tokenizer without a chat template renders a text prompt and a text response only; "
                            "give one with --chat-template FILE")
        for name in (o.prompt_fields[0], o.response_field):
            if record.get(name) is None:
                raise BadRecord(f"no text in {name!r}")
        prompt = self._turns(record[o.prompt_fields[0]], "user", o.prompt_fields[0])
        completion = self._turns(record[o.response_field], "assistant", o.response_field)
        if not any(m["role"] == "assistant" for m in completion):
            raise BadRecord(f"{o.response_field!r}: no assistant turn")
        return prompt + completion, sum(m["role"] == "assistant" for m in prompt)

    @staticmethod
    def _turns(value: Any, role: str, field: str) -> list[dict]:
        """``field``'s value as messages: a text is one turn of ``role``, a list is checked as a conversation."""
        if isinstance(value, str):
            if not value.strip():
                raise BadRecord(f"no text in {field!r}")
            return [{"role": role, "content": value}]
        return conversation(value, field)

    def render(self, messages: list[dict[str, Any]], tools: Optional[list] = None,
               skip: int = 0) -> tuple[str, list[Span]]:
        """The conversation's text and its supervised character spans (per ``train_on``); ``tools``:
        its tool definitions, given to every render of it. ``skip``: its first assistant turns that are
        not supervised (a preference pair's prompt, with ``train_on="assistant"``): neither bounded nor
        returned, unless a later turn's bound needs the previous turn's end."""
        if self.template is None:
            prompt, response = messages[0]["content"], messages[1]["content"]
            text = prompt + PLAIN_SEPARATOR + response
            return text, [(0 if self.options.train_on == "all" else len(text) - len(response), len(text))]
        if self.options.train_on == "all":
            text = self._render(messages, tools)
            return text, [(0, len(text))]
        turns = [i for i, m in enumerate(messages) if m["role"] == "assistant"][skip:]
        if self.options.train_on == "last_assistant":
            turns = turns[-1:]
        if self.markers:
            spans: list[Span] = []
            text = self._render(messages, tools, spans=spans)
            if not spans:
                raise BadRecord("the chat template marks no text of it with {% generation %}")
            spans = spans[skip:][-1:] if self.options.train_on == "last_assistant" else spans[skip:]
        else:
            text = self._render(messages, tools)
            spans = []
            for i in turns:
                spans.append(self._turn(messages, tools, i, text, spans[-1][1] if spans else None if skip else 0))
        if any(messages[i].get("weight") == 0 for i in turns):  # (OpenAI's and ShareGPT's turn weights)
            if len(turns) != len(spans):
                raise BadRecord(f"a turn of weight 0, and the chat template's {{% generation %}} blocks are "
                                f"{len(spans)} for {len(turns)} assistant turns: which to leave out is unknown")
            spans = [span for span, i in zip(spans, turns) if messages[i].get("weight") != 0]
            if not spans:
                raise BadRecord("every assistant turn it would train on has weight 0")
        return text, spans

    def _render(self, messages: list, tools: Optional[list] = None, generation_prompt: bool = False,
                spans: Optional[list[Span]] = None) -> str:
        variables = dict(self._variables, messages=messages, tools=tools, add_generation_prompt=generation_prompt)
        environment = self.template.environment
        try:
            blocks: list[str] = []
            if spans is not None:
                self._spans.blocks, self._spans.spans = blocks, spans
            environment.arm()
            try:
                written = 0
                for block in self.template.generate(variables):
                    blocks.append(block)
                    written += len(block)
                    if written > RENDER_CHARS:
                        raise RenderBound(f"it writes over {RENDER_CHARS:,} characters")
            finally:
                environment.deadline = math.inf
                self._spans.blocks = self._spans.spans = None
            return "".join(blocks)
        except RenderBound as err:
            raise TemplateFailure(f"the chat template ({self.spec.origin}) stops: {err}") from None
        except Exception as err:  # noqa: BLE001 - a template is code from a downloaded folder: any error is its own
            line = _template_line(err)
            message = " ".join(str(err).split())[:200] or type(err).__name__
            raise TemplateFailure(f"the chat template ({self.spec.origin}) fails"
                                  f"{f' at line {line}' if line else ''}: {message}") from None

    def _turn(self, messages: list, tools: Optional[list], i: int, text: str, after: Optional[int] = 0) -> Span:
        """The supervised span of assistant turn ``i`` in ``text`` (a template without markers):
        from the end of what the model is given at inference (the conversation before the turn,
        with the generation prompt when the template adds one) through the end-of-turn token after
        its content. A template that adds no prompt and renders the turns before this one
        otherwise on their own (Mistral's puts the system message into the last user turn): from
        the content, found after ``after`` (the previous turn's end; None: not bounded yet, then bounded
        here), and the whitespace before it.
        One render per turn for a template the probe understood; two or three otherwise."""
        end, start, adds = len(text), None, False
        if self._end_of_turn is None:  # bound the turn by rendering the conversation up to it
            upto = self._render(messages[:i + 1], tools)
            end = len(upto) if text.startswith(upto) else end
        if self._generation_prompt is not False:
            prompt = self._render(messages[:i], tools, generation_prompt=True)
            adds = bool(self._generation_prompt) or prompt != self._render(messages[:i], tools)  # None: no probe
            if adds and text.startswith(prompt) and len(prompt) <= end:
                start = len(prompt)
        origin, loose = start, False
        if origin is None:
            before = self._render(messages[:i], tools)
            if text.startswith(before):
                origin = len(before)
                start = None if adds else origin  # no generation prompt: all that follows is the model's
            elif not adds:
                if after is None:  # the previous assistant turn's end, bounded as render bounds it
                    previous = [j for j in range(i) if messages[j]["role"] == "assistant"]
                    after = self._turn(messages, tools, previous[-1], text, None)[1] if previous else 0
                origin, loose = after, True
            else:
                raise BadRecord(f"message {i}: the chat template renders the conversation before it differently "
                                f"from the start of the whole one; mark what to train on with {{% generation %}}")
        content = messages[i].get("content", "")  # none: a turn that only calls tools
        content_end = None
        # The content's first occurrence after the generation prompt; without one (the search then
        # starts at the turn's header), its last one in the turn.
        search = text.find if start is not None or end == len(text) else text.rfind
        for needle in dict.fromkeys((content, content.strip())):  # templates may trim the content
            found = search(needle, origin, end) if needle.strip() else -1
            if found >= 0:
                content_end = found + len(needle)
                start = found if start is None else start
                while loose and start > origin and text[start - 1].isspace():
                    start -= 1
                break
        if content_end is None:
            if start is None:
                raise BadRecord(f"message {i}: the chat template does not render the assistant's content as it is, "
                                f"nor has a generation prompt; mark what to train on with {{% generation %}}")
            content_end = start
        ends = self._end_of_turn or self._special
        match = ends.search(text, content_end, end) if ends is not None else None
        return start, match.end() if match else end

    def encode(self, rendered: Sequence[tuple[str, list[Span]]]) -> list[tuple[np.ndarray, np.ndarray]]:
        """Each (text, spans) as (ids int64, mask uint8): the text's tokens, and EOS after them when
        they do not end with it (mask 0 there; 1 in plain prompt/response text, where it ends the
        response)."""
        tokenizer, plain = self.tokenizer, self.template is None
        head = [tokenizer.bos_id] if plain and tokenizer.add_bos else []
        out = []
        for (_, spans), encoding in zip(rendered, tokenizer.encode_encodings([t for t, _ in rendered])):
            ids = encoding.ids
            mask = token_mask(encoding, spans)
            tail: list[int] = [] if ids and ids[-1] == tokenizer.eot_id and not plain else [tokenizer.eot_id]
            all_ = self.options.train_on == "all"
            out.append((np.array([*head, *ids, *tail], dtype=np.int64),
                        np.concatenate([np.full(len(head), all_, np.uint8), mask,
                                        np.full(len(tail), plain, np.uint8)])))
        return out

    def fit(self, ids: np.ndarray, mask: np.ndarray) -> tuple[Optional[tuple[np.ndarray, np.ndarray]], str]:
        """(the conversation within ``max_tokens``, or None to drop it; "kept", "truncated" or
        "dropped"). A truncation that leaves nothing supervised drops it."""
        limit = self.options.max_tokens
        if limit is None or len(ids) <= limit:
            return (ids, mask), "kept"
        if self.options.too_long == "drop" or not mask[:limit].any():
            return None, "dropped"
        return (ids[:limit], mask[:limit]), "truncated"


def check_supervised(index: dict[str, Any], field: str, path: str) -> None:
    """Before launch: an SFT shard set (``index``: its index.json) whose loss masks supervise no
    token has nothing to train on."""
    if not index.get("loss_mask"):
        return
    sft, shards = index.get("sft") or {}, index.get("shards", [])
    supervised = sft.get("supervised_tokens")
    if not isinstance(supervised, int) and all("supervised" in s for s in shards):
        supervised = sum(s["supervised"] for s in shards)
    if supervised == 0:
        raise ValueError(f"{field}={path!r}: its loss masks supervise none of its {index.get('total_tokens')} tokens "
                         f"(prepared with --train-on {sft.get('train_on', '?')}); prepare it again with the chat "
                         f"template that renders the assistant's turns, or --train-on all")
