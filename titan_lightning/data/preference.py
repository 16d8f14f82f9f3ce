"""Preference data: chosen / rejected pairs rendered with the chat template, and packed whole.

``titan-lightning prepare --preference`` reads the formats people publish (TRL's preference
datasets): an explicit prompt (``prompt``: a text, as one user turn, or a list of messages;
``chosen`` / ``rejected``: a text, as one assistant turn, or a list of messages that continue
the prompt, or whole conversations that repeat it), or the implicit-prompt form (``chosen`` /
``rejected`` whole conversations; the prompt is the messages they share from the start; a text
``prompt`` beside them, as ultrafeedback_binarized has, is read as TRL reads it: the shared
messages are the prompt), or its text form (hh-rlhf: the prompt is the text both answers begin
with, a user turn). Each answer is the prompt and that answer
rendered as SFT renders a conversation (data/chat.py: the folder's chat template, or plain
prompt + blank line + answer + EOS without one), with the mask on the answer's assistant turns
only. A pair is written as two documents, chosen then rejected, one after the other; a pair of
which either answer is too long for ``--max-tokens`` is dropped (``--too-long drop``) or both are
truncated (``truncate``; dropped when either is left with nothing supervised).

``PairWindows`` (data/pair_windows.py, apart so that ``prepare`` imports no torch) packs whole
pairs (never one answer without the other) into training windows, so
both sequences of a pair are in the same microbatch on the same rank; each sequence is a document
of its own (``model.mask="block_causal"``, ``model.positions="per_document"``). Besides the SFT
sample's ``input_ids``, ``labels`` and ``position_ids`` (data/sft.py), a window gives::

    sequence_ids   [seq_len]  the slot of the sequence each label belongs to (-1: none): pair k of
                              the window is slots 2k (chosen) and 2k + 1 (rejected)
    sequence_docs  [2P]       each slot's document index in the shard set (-1: an empty slot), by
                              which precomputed reference log-probabilities are found

(P: the most pairs a window of the set holds). The split between train and held-out documents may
fall between the two answers of one pair: that pair is left out of both.
"""

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Optional

from titan_lightning.data.chat import BadRecord, ChatOptions, ChatRenderer, ChatSpec, Span, conversation
# "fields" of a record that hold text as one turn: the prompt a user's, an answer the assistant's.
TEXT_ROLES = {"prompt": "user", "chosen": "assistant", "rejected": "assistant"}


@dataclass(frozen=True, kw_only=True)
class PreferenceOptions(ChatOptions):
    """Chat options for pairs: the record's ``prompt_field`` (optional: without it, the implicit
    form), ``chosen_field`` and ``rejected_field``. The base's prompt/response pair is (prompt,
    chosen), so its rules on pairs hold as they are."""

    chosen_field: str = "chosen"
    rejected_field: str = "rejected"
    tools_field: Optional[str] = None
    prompt_fields: tuple[str, ...] = ("prompt",)
    response_field: Optional[str] = "chosen"

    def __post_init__(self) -> None:
        super().__post_init__()
        names = [self.prompt_fields[0], self.chosen_field, self.rejected_field]
        if len(set(names)) != 3 or len(self.prompt_fields) != 1:
            raise ValueError(f"--preference reads three distinct fields: prompt, chosen and rejected (given: "
                             f"{', '.join(self.prompt_fields)}, {self.chosen_field}, {self.rejected_field})")
        if self.train_on != "assistant":
            raise ValueError(f"--train-on {self.train_on}: --preference supervises each answer's assistant turns "
                             f"only; leave --train-on out")

    @property
    def prompt_field(self) -> str:
        return self.prompt_fields[0]

    @property
    def fields(self) -> list[str]:
        return [self.chosen_field, self.rejected_field]

    @property
    def optional_fields(self) -> list[str]:
        return [self.prompt_field]

    @property
    def field_options(self) -> list[tuple[str, str, Any]]:
        return [(self.chosen_field, "--chosen-field", (str, list)), (self.rejected_field, "--rejected-field", (str, list))]


class PreferenceRenderer(ChatRenderer):
    """A record to its pair of (text, supervised spans): the prompt and each answer."""

    def pair(self, record: Any) -> tuple[list[dict], list[dict], int]:
        """(the chosen conversation, the rejected one, the messages of the prompt they share)."""
        o: PreferenceOptions = self.options
        if not isinstance(record, dict):
            raise BadRecord(f"not an object but a {type(record).__name__}")
        prompt = record.get(o.prompt_field)
        chosen, rejected = record.get(o.chosen_field), record.get(o.rejected_field)
        if prompt is not None and isinstance(chosen, list) and isinstance(rejected, list):
            chosen, rejected = conversation(chosen, o.chosen_field), conversation(rejected, o.rejected_field)
            turns = self._turns(prompt, TEXT_ROLES["prompt"], o.prompt_field)
            if chosen[:len(turns)] == turns and rejected[:len(turns)] == turns:
                return self._checked(chosen, rejected, len(turns))  # whole conversations that repeat the prompt
            if isinstance(prompt, str) and chosen[0]["role"] != "assistant":
                prompt = None  # a text prompt beside whole conversations (ultrafeedback_binarized): as TRL, implicit
            else:
                return self._checked(turns + chosen, turns + rejected, len(turns))
        if prompt is None:
            if isinstance(chosen, str) and isinstance(rejected, str):
                return self._text_pair(chosen, rejected)
            if not (isinstance(chosen, list) and isinstance(rejected, list)):
                raise BadRecord(f"no {o.prompt_field!r}, and {o.chosen_field!r} and {o.rejected_field!r} are not both "
                                f"conversations (lists of messages) or texts sharing their prompt")
            chosen, rejected = conversation(chosen, o.chosen_field), conversation(rejected, o.rejected_field)
            shared = _common_prefix(chosen, rejected)
            if not shared:
                raise BadRecord(f"{o.chosen_field!r} and {o.rejected_field!r} share no first message (the prompt of "
                                f"the implicit form); give the prompt in {o.prompt_field!r}")
            return self._checked(chosen, rejected, shared)
        prompt = self._turns(prompt, TEXT_ROLES["prompt"], o.prompt_field)
        chosen = prompt + self._turns(chosen, TEXT_ROLES["chosen"], o.chosen_field)
        rejected = prompt + self._turns(rejected, TEXT_ROLES["rejected"], o.rejected_field)
        return self._checked(chosen, rejected, len(prompt))

    def _text_pair(self, chosen: str, rejected: str) -> tuple[list[dict], list[dict], int]:
        """The implicit form in text (Anthropic's hh-rlhf): the prompt is the text both answers begin
        with, up to the last white space before they differ (an answer starts at a word, "Blue" and
        "Bright" share no "B"), as one user turn; the white space stays with the answers."""
        o: PreferenceOptions = self.options
        shared = _common_prefix(chosen, rejected)
        while shared and not chosen[shared - 1].isspace():
            shared -= 1
        shared = len(chosen[:shared].rstrip())
        if not shared:
            raise BadRecord(f"{o.chosen_field!r} and {o.rejected_field!r} are texts sharing no prompt (the text both "
                            f"begin with); give the prompt in {o.prompt_field!r}")
        prompt = [{"role": TEXT_ROLES["prompt"], "content": chosen[:shared]}]
        return self._checked(prompt + self._turns(chosen[shared:], TEXT_ROLES["chosen"], o.chosen_field),
                             prompt + self._turns(rejected[shared:], TEXT_ROLES["rejected"], o.rejected_field), 1)

    def _checked(self, chosen: list[dict], rejected: list[dict], shared: int) -> tuple[list[dict], list[dict], int]:
        """(chosen, rejected, shared), each answer checked to hold an assistant turn after the prompt."""
        o: PreferenceOptions = self.options
        for name, messages in ((o.chosen_field, chosen), (o.rejected_field, rejected)):
            if not any(m["role"] == "assistant" for m in messages[shared:]):
                raise BadRecord(f"{name!r}: no assistant turn after the prompt")
        if chosen == rejected:
            raise BadRecord(f"{o.chosen_field!r} and {o.rejected_field!r} are the same")
        return chosen, rejected, shared

    def conversation(self, record: Any) -> tuple[list[dict[str, Any]], int]:
        """The chosen conversation and its prompt's assistant turns (what ``prepare`` renders first,
        to check the template)."""
        chosen, _, shared = self.pair(record)
        return chosen, sum(m["role"] == "assistant" for m in chosen[:shared])

    def render_pair(self, record: Any) -> list[tuple[str, list[Span]]]:
        """[(the chosen conversation's text, the spans of its answer), (the rejected one's, ...)]."""
        chosen, rejected, shared = self.pair(record)
        if self.template is None and not all(len(m) == 2 and m[0]["role"] == "user" for m in (chosen, rejected)):
            raise BadRecord("a tokenizer without a chat template renders a text prompt and text answers only; give "
                            "one with --chat-template FILE")
        prior = sum(m["role"] == "assistant" for m in chosen[:shared])  # the prompt's own assistant turns
        out = []
        for messages in (chosen, rejected):
            text, spans = self.render(messages, skip=prior if self.template is not None else 0)
            if not spans:
                raise BadRecord("the chat template marks none of the answer's text")
            out.append((text, spans))
        return out


def _common_prefix(a: Sequence, b: Sequence) -> int:
    """How many first items (messages, characters) ``a`` and ``b`` share."""
    shared = 0
    while shared < min(len(a), len(b)) and a[shared] == b[shared]:
        shared += 1
    return shared


def renderer_for(spec: ChatSpec, tokenizer) -> ChatRenderer:
    """The renderer of ``spec``'s records: pairs (PreferenceOptions) or conversations."""
    return (PreferenceRenderer if isinstance(spec.options, PreferenceOptions) else ChatRenderer)(spec, tokenizer)


def check_pairs(index: dict[str, Any], loss: Optional[str], field: str, path: str) -> None:
    """Before launch: a preference run (``loss``: preference.loss) reads a set of pairs, and a set of
    pairs is read by a preference run only (SFT on it would train on the rejected answers too)."""
    pairs = (index.get("sft") or {}).get("pairs")
    if loss is not None and pairs is None:
        raise ValueError(f"{field}={path!r} holds no preference pairs (it was prepared without --preference), and "
                         f"preference.loss={loss!r} trains on pairs; prepare it with --preference, or unset "
                         f"preference.loss")
    if loss is None and pairs is not None:
        raise ValueError(f"{field}={path!r} holds {pairs} preference pairs (prepare --preference), and "
                         f"preference.loss=None would train on the rejected answers too; set --job.preference.loss "
                         f"dpo (or ipo, simpo)")
