"""`titan-lightning prepare` on chat and instruction data: conversations rendered with real chat
templates (Llama 3.2, Qwen 3, a ChatML one with {% generation %} markers), their loss masks token by
token, tool definitions and tool calls, --train-on, --max-tokens/--too-long, bad records, bad input,
the sandbox, and the shards' mask files and index; data as it is published: ShareGPT's {from, value},
TRL's conversational prompt-completion, OpenAI's turn weights, .json files holding one array."""

import json
import re
import shutil
import time
from pathlib import Path

import numpy as np
import pytest

from test_shards import interrupted_at_part
from titan_lightning.data import prepare as prepare_module
from titan_lightning.data.chat import (BadRecord, ChatOptions, ChatRenderer, ChatSpec, TemplateFailure,
                                      read_chat_template)
from titan_lightning.data.prepare import PrepareError, main, prepare
from titan_lightning.data.shards import ShardSet
from titan_lightning.data.tokenizer import TOKENIZER_PATH, load_tokenizer

TEMPLATES = Path(__file__).resolve().parents[2] / "assets" / "chat_templates"
NOW = "2024-07-26T12:00:00"  # what strftime_now renders in these tests (Llama 3.2 writes today's date)

SYSTEM = {"role": "system", "content": "You are terse."}
USER = {"role": "user", "content": "What is 2+2?"}
ANSWER = {"role": "assistant", "content": "4."}
MULTI_TURN = [SYSTEM, USER, ANSWER, {"role": "user", "content": "Weather?"},
              {"role": "assistant", "content": "Let me check."}, {"role": "tool", "content": "sunny"},
              {"role": "assistant", "content": "It is sunny."}]
LLAMA_HEAD = ("<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nCutting Knowledge Date: December 2023\n"
              "Today Date: 26 Jul 2024\n\nYou are terse.<|eot_id|><|start_header_id|>user<|end_header_id|>\n\n"
              "What is 2+2?<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n")


def _tokenizer_folder(folder: Path, specials: list[str], config: dict, bos_first: bool = False) -> Path:
    """The shipped byte-level BPE with a checkpoint's special tokens added, and its config;
    ``bos_first``: its post-processor puts the first special token first (as Llama 3's does)."""
    from tokenizers import AddedToken, Tokenizer, processors

    folder.mkdir(parents=True)
    tokenizer = Tokenizer.from_file(str(TOKENIZER_PATH))
    tokenizer.add_special_tokens([AddedToken(token, special=True) for token in specials])
    if bos_first:
        bos = specials[0]
        tokenizer.post_processor = processors.TemplateProcessing(single=f"{bos} $A",
                                                                 special_tokens=[(bos, tokenizer.token_to_id(bos))])
    tokenizer.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("tokenizers")
    llama = _tokenizer_folder(root / "llama", ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
                                               "<|eot_id|>"],
                              {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>",
                               "chat_template": (TEMPLATES / "llama3.2.jinja").read_text()}, bos_first=True)
    qwen = _tokenizer_folder(root / "qwen", ["<|im_start|>", "<|im_end|>"], {"eos_token": "<|im_end|>"})
    shutil.copy(TEMPLATES / "qwen3.jinja", qwen / "chat_template.jinja")  # as newer HF folders keep it
    plain = _tokenizer_folder(root / "plain", ["<|im_start|>", "<|im_end|>"], {"eos_token": "<|endoftext|>"})
    return {"llama": llama, "qwen": qwen, "plain": plain}


def _renderer(folder: Path, template: str = None, **options) -> ChatRenderer:
    options.setdefault("messages_field", "messages")
    source, origin = (template, "test") if template is not None else read_chat_template(str(folder), None)
    return ChatRenderer(ChatSpec(ChatOptions(**options), source, origin, NOW), load_tokenizer(str(folder)))


def _runs(renderer: ChatRenderer, messages: list, tools: list = None) -> list[tuple[int, str]]:
    """The conversation as runs of (mask, decoded text): every token's mask, in order."""
    (ids, mask), = renderer.encode([renderer.render(messages, tools)])
    runs: list[list] = []
    for token, bit in zip(ids.tolist(), mask.tolist()):
        piece = renderer.tokenizer.decode([token])
        if runs and runs[-1][0] == bit:
            runs[-1][1] += piece
        else:
            runs.append([bit, piece])
    return [tuple(run) for run in runs]


def test_llama3_system_user_assistant_supervises_the_answer_and_its_eot(folders):
    renderer = _renderer(folders["llama"])
    assert _runs(renderer, [SYSTEM, USER, ANSWER]) == [(0, LLAMA_HEAD), (1, "4.<|eot_id|>")]
    (ids, _), = renderer.encode([renderer.render([SYSTEM, USER, ANSWER])])
    tokenizer = renderer.tokenizer
    assert tokenizer.add_bos  # its post-processor adds BOS to plain text; the template has its own
    assert ids[0] == tokenizer.bos_id and (ids == tokenizer.bos_id).sum() == 1  # the template's BOS, not a second
    assert ids[-1] == tokenizer.eot_id and (ids == tokenizer.eot_id).sum() == 3  # ends with EOS: none appended


def test_multi_turn_with_a_tool_turn_supervises_each_assistant_turn_only(folders):
    assert _runs(_renderer(folders["llama"]), MULTI_TURN) == [
        (0, LLAMA_HEAD), (1, "4.<|eot_id|>"),
        (0, "<|start_header_id|>user<|end_header_id|>\n\nWeather?<|eot_id|><|start_header_id|>assistant"
            "<|end_header_id|>\n\n"), (1, "Let me check.<|eot_id|>"),
        (0, '<|start_header_id|>ipython<|end_header_id|>\n\n"sunny"<|eot_id|><|start_header_id|>assistant'
            '<|end_header_id|>\n\n'), (1, "It is sunny.<|eot_id|>")]
    # Qwen 3 renders the last turn with an (empty) think block the model must write, and the turns
    # before it differently as the last of a prefix: the spans still come from the whole rendering.
    # Its EOS <|im_end|> is not the last token ("\n" is): one is appended, not supervised.
    assert _runs(_renderer(folders["qwen"]), MULTI_TURN) == [
        (0, "<|im_start|>system\nYou are terse.<|im_end|>\n<|im_start|>user\nWhat is 2+2?<|im_end|>\n"
            "<|im_start|>assistant\n"), (1, "4.<|im_end|>"),
        (0, "\n<|im_start|>user\nWeather?<|im_end|>\n<|im_start|>assistant\n"), (1, "Let me check.<|im_end|>"),
        (0, "\n<|im_start|>user\n<tool_response>\nsunny\n</tool_response><|im_end|>\n<|im_start|>assistant\n"),
        (1, "<think>\n\n</think>\n\nIt is sunny.<|im_end|>"), (0, "\n<|im_end|>")]


def test_train_on_last_assistant_and_all(folders):
    last = _runs(_renderer(folders["llama"], train_on="last_assistant"), MULTI_TURN)
    assert [bit for bit, _ in last] == [0, 1] and last[1][1] == "It is sunny.<|eot_id|>"
    everything = _runs(_renderer(folders["qwen"], train_on="all"), MULTI_TURN)
    assert [bit for bit, _ in everything] == [1, 0] and everything[1][1] == "<|im_end|>"  # but the appended EOS


def test_a_template_with_generation_markers_gives_the_mask_of_the_same_template_without(folders):
    marked = (TEMPLATES / "chatml_generation.jinja").read_text()
    unmarked = marked.replace("{% generation %}", "").replace("{% endgeneration %}", "")
    assert "generation %}" not in unmarked
    for conversation in ([USER, ANSWER], MULTI_TURN):
        for train_on in ("assistant", "last_assistant"):
            with_markers = _renderer(folders["qwen"], marked, train_on=train_on)
            without = _renderer(folders["qwen"], unmarked, train_on=train_on)
            assert with_markers.markers and not without.markers
            runs = _runs(with_markers, conversation)
            assert runs == _runs(without, conversation)
            assert [text for bit, text in runs if bit] == (
                ["4.<|im_end|>"] if conversation == [USER, ANSWER] or train_on == "assistant" else []
            ) + (["Let me check.<|im_end|>", "It is sunny.<|im_end|>"] if conversation == MULTI_TURN and
                 train_on == "assistant" else ["It is sunny.<|im_end|>"] if conversation == MULTI_TURN else [])


def test_a_template_without_a_generation_prompt_supervises_what_the_model_writes_after_the_prompt(tmp_path):
    """Mistral-style ([INST] ... [/INST] answer</s>, no generation prompt): given "...[/INST]" at
    inference, the model writes " answer</s>", the space included, in every turn (also where the
    template moves the system message into the last user turn): the mask of the same template with
    {% generation %} around the assistant's text, and transformers' assistant mask of that one."""
    from transformers import AutoTokenizer

    folder = _tokenizer_folder(tmp_path / "mistral", ["<s>", "</s>", "[INST]", "[/INST]"],
                               {"bos_token": "<s>", "eos_token": "</s>"})
    template = (TEMPLATES / "mistral_v0.3_like.jinja").read_text()
    answer = '{{- " " + message["content"]|trim + eos_token }}'
    marked = template.replace(answer, "{% generation %}" + answer + "{% endgeneration %}")
    assert marked != template
    second = [{"role": "user", "content": "Weather?"}, {"role": "assistant", "content": "It is sunny."}]
    renderer = _renderer(folder, template)
    assert renderer._generation_prompt is False
    for conversation in ([USER, ANSWER, *second], [SYSTEM, USER, ANSWER, *second]):
        text, spans = renderer.render(conversation)  # characters: whatever the tokens are
        assert [text[a:b] for a, b in spans] == [" 4.</s>", " It is sunny.</s>"]
    assert _runs(renderer, [SYSTEM, USER, ANSWER]) == [(0, "<s>[INST] You are terse.\n\nWhat is 2+2?[/INST]"),
                                                       (1, " 4.</s>")]
    assert _runs(renderer, [SYSTEM, USER, ANSWER, *second]) == [
        (0, "<s>[INST] What is 2+2?[/INST]"), (1, " 4.</s>"), (0, "[INST] You are terse.\n\nWeather?[/INST]"),
        (1, " It is sunny.</s>")]
    hf = AutoTokenizer.from_pretrained(str(folder))
    for conversation in ([USER, ANSWER], [SYSTEM, USER, ANSWER, *second], [USER, ANSWER, *second]):
        (ids, mask), = renderer.encode([renderer.render(conversation)])
        assert _runs(_renderer(folder, marked), conversation) == _runs(renderer, conversation)
        theirs = hf.apply_chat_template(conversation, chat_template=marked, tokenize=True, return_dict=True,
                                        return_assistant_tokens_mask=True)
        assert ids.tolist() == list(theirs["input_ids"]) and mask.tolist() == list(theirs["assistant_masks"])


def test_a_template_that_loops_makes_a_bad_record_named_in_bounded_time(folders, tmp_path, monkeypatch):
    """Nested loops that never end (on one record), or a string multiplied past the output bound:
    the record is bad (named file:line), skipped and counted or stopping the run, within the
    render bound (cut to 0.2 s here)."""
    from titan_lightning.data import chat as chat_module

    monkeypatch.setattr(chat_module, "RENDER_SECONDS", 0.2)
    loop = ("{% for m in messages %}{% if m.content == 'loop' %}{% for i in range(100000) %}{% for j in range(100000) %}"
            "{% endfor %}{% endfor %}{% endif %}{{ m.role }}: {{ m.content }}<|im_end|>{% endfor %}")
    (tmp_path / "loop.jinja").write_text(loop)
    (tmp_path / "huge.jinja").write_text(loop.replace("{% for i in range(100000) %}{% for j in range(100000) %}"
                                                      "{% endfor %}{% endfor %}", "{{ 'x' * 10 ** 9 }}"))
    records = [{"messages": [USER, ANSWER]}, {"messages": [{"role": "user", "content": "loop"}, ANSWER]},
               {"messages": [USER, ANSWER]}]
    path = _jsonl(tmp_path / "chats.jsonl", records)
    start = time.monotonic()
    for name, why in (("loop", "it renders for over 0.2 s"), ("huge", "it makes a sequence of 1,000,000,000 items")):
        options = ChatOptions(messages_field="messages", template=str(tmp_path / f"{name}.jinja"))
        summary = prepare([str(path)], str(tmp_path / name), tokenizer_path=str(folders["qwen"]), workers=1,
                          progress=False, chat=options)
        assert summary["sft"]["conversations"] == 2 and summary["bad_records"] == 1
        assert summary["first_bad"].startswith(f"{path}:2: the chat template (--chat-template ") and why in \
            summary["first_bad"]
        with pytest.raises(PrepareError, match=rf"^{path}:2: the chat template .* stops: {why}.*\(--bad-records stop\)$"):
            prepare([str(path)], str(tmp_path / f"{name}-stop"), tokenizer_path=str(folders["qwen"]), workers=1,
                    progress=False, chat=options, bad_records="stop")
    assert time.monotonic() - start < 20


def test_the_mask_from_span_ends_equals_the_rule_on_every_token(folders):
    """token_mask (char_to_token at each span's ends) is the every-token rule: a token is
    supervised when any of its characters is; also where a span starts or ends inside a token."""
    from titan_lightning.data.chat import offsets_mask, token_mask

    tokenizer = load_tokenizer(str(folders["qwen"]))
    for name in ("llama", "qwen"):
        renderer = _renderer(folders[name])
        text, spans = renderer.render(MULTI_TURN)
        encoding, = tokenizer.encode_encodings([text])
        cut = [(a + 1, b - 2) for a, b in spans] + [(3, 4), (len(text) - 1, len(text))]  # inside tokens
        for case in (spans, cut):
            assert token_mask(encoding, case).tolist() == offsets_mask(encoding.offsets, case).tolist()


def test_templates_the_probe_does_not_understand_are_bounded_by_prefix_renders(folders):
    """No special token ends a turn (plain "role: content" lines): the turn ends where the next
    begins. A template that fails on the probe (it wants a system message first) still gives the
    mask of the same template without that demand."""
    plain = ("{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
             "{% if add_generation_prompt %}assistant: {% endif %}")
    renderer = _renderer(folders["qwen"], plain)
    assert renderer._end_of_turn is None
    assert _runs(renderer, [USER, ANSWER, {"role": "user", "content": "More?"}, {"role": "assistant",
                                                                             "content": "No."}]) == [
        (0, "user: What is 2+2?\nassistant:"), (1, " 4.\n"), (0, "user: More?\nassistant:"), (1, " No.\n"),
        (0, "<|im_end|>")]  # " 4" is one token, and has a supervised character: supervised
    chatml = (TEMPLATES / "chatml_generation.jinja").read_text().replace("{% generation %}", "").replace(
        "{% endgeneration %}", "")
    demanding = "{% if messages[0].role != 'system' %}{{ raise_exception('a system message first') }}{% endif %}"
    picky = _renderer(folders["qwen"], demanding + chatml)
    assert picky._generation_prompt is None and picky._end_of_turn is None
    assert _runs(picky, MULTI_TURN) == _runs(_renderer(folders["qwen"], chatml), MULTI_TURN)


def _jsonl(path: Path, records) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def _read(folder: Path) -> tuple[list[np.ndarray], list[np.ndarray], dict]:
    """Each document's ids and mask (from .tokens, .mask and .docs), and the index."""
    index = json.loads((folder / "index.json").read_text())
    ids, masks = [], []
    for shard in index["shards"]:
        tokens = ShardSet(folder).dtype
        t = np.fromfile(folder / f"{shard['name']}.tokens", dtype=tokens)
        m = np.fromfile(folder / f"{shard['name']}.mask", dtype=np.uint8)
        ends = np.fromfile(folder / f"{shard['name']}.docs", dtype="<i8")
        assert len(m) == len(t) == shard["tokens"] and int(m.sum()) == shard["supervised"]
        for a, b in zip([0, *ends[:-1]], ends):
            ids.append(t[a:b].astype(np.int64))
            masks.append(m[a:b])
    return ids, masks, index


def test_prepare_writes_masks_next_to_tokens_and_counts_what_is_too_long(folders, tmp_path):
    records = [{"messages": [USER, {"role": "assistant", "content": " ".join(["word"] * n)}]} for n in (2, 40, 3)]
    path = _jsonl(tmp_path / "chats.jsonl", records)
    renderer = _renderer(folders["qwen"])
    whole = renderer.encode([renderer.render(r["messages"]) for r in records])
    limit = len(whole[1][0]) - 5
    assert len(whole[0][0]) < limit and len(whole[2][0]) < limit
    for too_long in ("drop", "truncate"):
        out = tmp_path / too_long
        summary = prepare([str(path)], str(out), tokenizer_path=str(folders["qwen"]), workers=1, progress=False,
                          chat=ChatOptions(messages_field="messages", max_tokens=limit, too_long=too_long))
        ids, masks, index = _read(out)
        kept = [whole[0], whole[2]] if too_long == "drop" else [whole[0], (w[:limit] for w in whole[1]), whole[2]]
        kept = [tuple(k) for k in kept]
        assert [i.tolist() for i in ids] == [k[0].tolist() for k in kept]
        assert [m.tolist() for m in masks] == [k[1].tolist() for k in kept]
        sft = index["sft"]
        assert index["loss_mask"] is True and sft == summary["sft"]
        assert (sft["truncated"], sft["dropped"]) == ((0, 1) if too_long == "drop" else (1, 0))
        assert sft["conversations"] == len(ids) and sft["supervised_tokens"] == sum(int(m.sum()) for m in masks)
        assert sft["train_on"] == "assistant" and sft["max_tokens"] == limit and sft["too_long"] == too_long
        assert sft["chat_template_sha256"] == renderer.spec.template_sha256


def _on_day(monkeypatch, day: str) -> None:
    """Runs of prepare started from now on render ``day`` as today's date (Llama 3.2 writes it)."""
    from datetime import datetime

    from titan_lightning.data import chat as chat_module

    class Clock(datetime):
        @classmethod
        def now(cls, tz=None):
            return datetime.fromisoformat(day)

    monkeypatch.setattr(chat_module, "datetime", Clock)


def test_the_output_does_not_depend_on_workers_and_a_resume_renders_the_first_run_s_date(folders, tmp_path,
                                                                                          monkeypatch):
    monkeypatch.setattr(prepare_module, "PART_BYTES", 1_500)
    records = [{"messages": [USER, {"role": "assistant", "content": f"answer {i} " * (i % 7 + 1)}]} for i in range(60)]
    path = _jsonl(tmp_path / "chats.jsonl", records)
    assert len(prepare_module.plan_parts([path])) > 3
    options = ChatOptions(messages_field="messages")
    _on_day(monkeypatch, "2024-07-26T23:59:59")
    for workers in (1, 2):
        prepare([str(path)], str(tmp_path / f"w{workers}"), tokenizer_path=str(folders["llama"]), workers=workers,
                progress=False, chat=options)
    names = sorted(p.name for p in (tmp_path / "w1").iterdir())
    assert any(n.endswith(".mask") for n in names) and names == sorted(p.name for p in (tmp_path / "w2").iterdir())
    for name in names:
        assert (tmp_path / "w1" / name).read_bytes() == (tmp_path / "w2" / name).read_bytes(), name

    with interrupted_at_part(3):
        prepare([str(path)], str(tmp_path / "resumed"), tokenizer_path=str(folders["llama"]), workers=1,
                progress=False, chat=options)
    _on_day(monkeypatch, "2024-07-27T00:00:01")  # resumed after midnight: still the first run's date
    prepare([str(path)], str(tmp_path / "resumed"), tokenizer_path=str(folders["llama"]), workers=1,
            progress=False, chat=options)
    for name in names:
        assert (tmp_path / "w1" / name).read_bytes() == (tmp_path / "resumed" / name).read_bytes(), name


def test_one_file_is_shared_by_two_workers_with_progress_by_bytes(folders, tmp_path, monkeypatch, capsys):
    """A JSONL file of one part cut into pieces for two worker processes: the shards, masks and
    index of one worker; the workers' shared counter reaches the file's bytes and the tokens
    written, and a log (stderr not a terminal) gets progress lines with tokens/s and an ETA."""
    records = [{"messages": [USER, {"role": "assistant", "content": f"answer {i} " * (i % 9 + 1)}]} for i in range(80)]
    path = _jsonl(tmp_path / "chats.jsonl", records)
    options = ChatOptions(messages_field="messages")
    prepare([str(path)], str(tmp_path / "w1"), tokenizer_path=str(folders["qwen"]), workers=1, progress=False,
            chat=options)
    monkeypatch.setattr(prepare_module, "MIN_PIECE_BYTES", 1_000)
    monkeypatch.setattr(prepare_module, "LOG_EVERY_S", 0.01)
    counters, real_counter = [], prepare_module._counter
    monkeypatch.setattr(prepare_module, "_counter", lambda: counters.append(real_counter()) or counters[-1])
    summary = prepare([str(path)], str(tmp_path / "w2"), tokenizer_path=str(folders["qwen"]), workers=2,
                      progress=True, chat=options)
    assert len(prepare_module.split_part(prepare_module.plan_parts([path])[0], 4)) == 4
    names = sorted(p.name for p in (tmp_path / "w1").iterdir())
    assert names == sorted(p.name for p in (tmp_path / "w2").iterdir())
    for name in names:
        assert (tmp_path / "w1" / name).read_bytes() == (tmp_path / "w2" / name).read_bytes(), name
    assert counters[0][:] == [path.stat().st_size, summary["tokens"]]
    lines = capsys.readouterr().err.splitlines()
    assert lines and all(re.fullmatch(r"prepare: [\d.]+k?B of [\d.]+kB \(\d+%\), [\d,]+ tokens/s, ETA (\S+ s|\?)", line)
                         for line in lines), lines


def test_prompt_response_pairs_through_the_template_or_as_plain_text(folders, tmp_path):
    alpaca = [{"instruction": "Add the numbers.", "input": "2 and 2", "output": "4"},
              {"instruction": "Say hi.", "input": "", "output": "hi"}]
    path = _jsonl(tmp_path / "alpaca.jsonl", alpaca)
    options = ChatOptions(prompt_fields=("instruction", "input"), response_field="output")
    prepare([str(path)], str(tmp_path / "chat"), tokenizer_path=str(folders["qwen"]), workers=1, progress=False,
            chat=options)
    renderer = _renderer(folders["qwen"])
    ids, masks, _ = _read(tmp_path / "chat")
    expected = renderer.encode([renderer.render([{"role": "user", "content": "Add the numbers.\n\n2 and 2"},
                                                 {"role": "assistant", "content": "4"}])])[0]
    assert ids[0].tolist() == expected[0].tolist() and masks[0].tolist() == expected[1].tolist()
    # No chat template: prompt, a blank line, response, EOS; the mask on the response and EOS.
    prepare([str(path)], str(tmp_path / "plain"), tokenizer_path=str(folders["plain"]), workers=1, progress=False,
            chat=options)
    tokenizer = load_tokenizer(str(folders["plain"]))
    ids, masks, index = _read(tmp_path / "plain")
    assert index["sft"]["chat_template_sha256"] is None
    decoded = [[(int(b), tokenizer.decode([t])) for t, b in zip(i.tolist(), m.tolist())] for i, m in zip(ids, masks)]
    assert "".join(p for _, p in decoded[1]) == "Say hi.\n\nhi<|endoftext|>"  # the empty input left out
    assert "".join(p for b, p in decoded[0] if b) == "4<|endoftext|>"
    assert "".join(p for b, p in decoded[0] if not b) == "Add the numbers.\n\n2 and 2\n\n"


def test_bad_records_are_skipped_and_counted_or_stop_the_run(folders, tmp_path):
    raise_on_bot = "{% for m in messages %}{% if m.content == 'boom' %}{{ raise_exception('no booms') }}{% endif %}" \
                   "{{ '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{% endfor %}"
    (tmp_path / "t.jinja").write_text(raise_on_bot)
    records = [{"messages": [USER, ANSWER]}, {"messages": [USER]}, {"messages": [{"role": "bot", "content": "x"},
               ANSWER]}, {"messages": [USER, {"role": "assistant", "content": ["4."]}]},
               {"messages": [USER, {"role": "assistant", "content": "boom"}]}, {"messages": "hi"}]
    path = _jsonl(tmp_path / "chats.jsonl", records)
    options = ChatOptions(messages_field="messages", template=str(tmp_path / "t.jinja"))
    summary = prepare([str(path)], str(tmp_path / "out"), tokenizer_path=str(folders["qwen"]), workers=1,
                      progress=False, chat=options)
    assert summary["bad_records"] == 5 and summary["sft"]["conversations"] == 1
    assert summary["first_bad"] == f"{path}:2: no assistant turn"
    messages = {2: "no assistant turn", 3: "message 0: unknown role 'bot'; roles: system, user, assistant, tool",
                4: "message 1 (assistant): content is list, not a string",
                5: f"the chat template (--chat-template {tmp_path}/t.jinja) fails at line 1: no booms",
                6: "no conversation in 'messages' (a list of {role, content} messages)"}
    for line, message in messages.items():
        lines = [json.dumps(records[0])] * (line - 1) + [json.dumps(records[line - 1])]
        one = _jsonl(tmp_path / f"bad{line}.jsonl", map(json.loads, lines))
        with pytest.raises(PrepareError) as err:
            prepare([str(one)], str(tmp_path / f"stop{line}"), tokenizer_path=str(folders["qwen"]), workers=1,
                    progress=False, bad_records="stop", chat=options)
        assert str(err.value) == f"{one}:{line}: {message} (--bad-records stop)"
        assert not (tmp_path / f"stop{line}").exists()


@pytest.mark.parametrize("args, message", [
    (["--chat", "--tokenizer", "{plain}"], "--chat: --tokenizer '{plain}' has no chat template (no "
     "chat_template.jinja, no chat_template in tokenizer_config.json); give one with --chat-template FILE, or read "
     "prompt/response pairs with --prompt-field and --response-field"),
    (["--chat"], "--chat: the shipped tokenizer has no chat template"),
    (["--chat", "--tokenizer", "{qwen}", "--chat-template", "{d}/syntax.jinja"],
     "--chat-template {d}/syntax.jinja: line 2: Encountered unknown tag 'endfor'"),
    (["--chat", "--tokenizer", "{qwen}", "--chat-template", "{d}/undefined.jinja"],
     "{d}/c.jsonl:1: the chat template (--chat-template {d}/undefined.jinja) fails at line 3: 'dict object' has "
     "no attribute 'name'"),
    (["--chat", "--tokenizer", "{qwen}", "--chat-template", "{d}/escape.jinja"],
     "{d}/c.jsonl:1: the chat template (--chat-template {d}/escape.jinja) fails at line 1: no loader for this "
     "environment specified"),
    (["--chat", "--tokenizer", "{qwen}", "--chat-template", "{d}/missing.jinja"],
     "--chat-template '{d}/missing.jinja': no such file"),
    (["--chat", "--prompt-field", "p", "--response-field", "r"], "--chat reads a messages field; "
     "--prompt-field/--response-field read prompt/response pairs: give one or the other"),
    (["--prompt-field", "instruction"], "prompt/response pairs need both --prompt-field and --response-field"),
    (["--messages-field", "turns"], "--messages-field 'turns' applies to conversations; add --chat"),
    (["--tools-field", "fns"], "--tools-field 'fns' applies to conversations; add --chat"),
    (["--chat", "--tools-field", "messages"], "--tools-field 'messages' is also --messages-field: name the field "
     "of the tool definitions"),
    (["--max-tokens", "9"], "--max-tokens applies to chat and instruction data; add --chat"),
    (["--chat", "--too-long", "truncate"], "--too-long truncate needs --max-tokens N"),
    (["--chat", "--text-field", "text"], "--text-field names plain text"),
    (["--chat", "--max-tokens", "1"], "--max-tokens=1: expected >= 2"),
    (["--chat", "--train-on", "user"], "prepare: argument --train-on: invalid choice: 'user'"),
    (["--chat", "--messages-field", "turns", "--tokenizer", "{qwen}"],
     "{d}/c.jsonl:1: no list field 'turns' (--messages-field); the record has: messages"),
    (["--chat", "--tools-field", "functons", "--tokenizer", "{qwen}"],
     "--tools-field 'functons': no record has this field; the records have: messages"),
    (["--chat", "--tokenizer", "{qwen}", "--max-tokens", "2", "--too-long", "truncate"],
     "{d}/c.jsonl: all its 1 conversations that are not bad records have no supervised token in their first "
     "--max-tokens 2 (--too-long truncate drops a conversation left with nothing to train on); raise --max-tokens"),
])
def test_bad_input_is_one_line_before_any_work(folders, tmp_path, args, message):
    d = tmp_path
    (d / "syntax.jinja").write_text("{% for m in messages %}\n{% endfor %}{% endfor %}")
    (d / "undefined.jinja").write_text("{% for m in messages %}\n{{ m.content }}\n{{ m.name.first }}{% endfor %}")
    (d / "escape.jinja").write_text("{% include '/etc/passwd' %}{{ messages.__class__.__mro__ }}")
    _jsonl(d / "c.jsonl", [{"messages": [USER, ANSWER]}])
    names = {"d": d, "qwen": folders["qwen"], "plain": folders["plain"]}
    argv = ["--input", str(d / "c.jsonl"), "--output", str(d / "out"), "--workers", "1", "--no-progress"]
    with pytest.raises(PrepareError) as err:
        main(argv + [a.format(**names) for a in args])
    assert str(err.value).startswith(message.format(**names)) and "\n" not in str(err.value)
    assert not (d / "out").exists()


@pytest.mark.parametrize("record, args, hint", [
    ({"messages": [USER, ANSWER]}, [], "conversations: --chat"),
    ({"prompt": "Hi", "completion": "Hello"}, [], "prompt-completion data: --prompt-field prompt --response-field "
     "completion"),
    ({"prompt": [USER], "completion": [ANSWER]}, ["--chat"], "prompt-completion data: --prompt-field prompt "
     "--response-field completion"),
    ({"instruction": "Add", "input": "2 2", "output": "4"}, [], "Alpaca data: --prompt-field instruction,input "
     "--response-field output"),
    ({"prompt": "Hi", "chosen": "Hello", "rejected": "Go"}, ["--chat"], "preference pairs: --preference"),
])
def test_records_of_a_known_layout_read_with_the_wrong_flags_name_the_right_ones(folders, tmp_path, record, args,
                                                                                 hint):
    _jsonl(tmp_path / "c.jsonl", [record])
    with pytest.raises(PrepareError, match=f"; {re.escape(hint)}$"):
        main(["--input", str(tmp_path / "c.jsonl"), "--output", str(tmp_path / "out"), "--tokenizer",
              str(folders["qwen"]), *args])
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("source, unsafe", [
    ("{{ ''.__class__.__mro__[1].__subclasses__() }}", "attribute '__class__' of 'str'"),
    ("{{ strftime_now.__globals__['os'] }}", "attribute '__globals__' of 'function'"),
    ("{{ messages.append(1) }}", "attribute 'append' of 'list'"),  # immutable: the data cannot be changed
])
def test_the_sandbox_keeps_templates_from_python_objects(folders, source, unsafe):
    with pytest.raises(TemplateFailure, match=f"fails at line 1: access to {unsafe} object is unsafe"):
        _renderer(folders["qwen"], source).render([USER, ANSWER])
    harmless = _renderer(folders["qwen"], "{{ messages.__class__ }}{{ lipsum.__globals__ }}", train_on="all")
    assert harmless.render([USER, ANSWER])[0] == ""  # attributes of Python objects are undefined


def test_the_cli_prints_the_summary_and_reads_parquet_conversations(folders, tmp_path, capsys, monkeypatch):
    pa = pytest.importorskip("pyarrow", reason="Parquet support is the optional [parquet] extra")
    import pyarrow.parquet as pq
    _on_day(monkeypatch, NOW)  # the run renders the date the expected conversations below have

    # Parquet gives every message of the column a "tool_calls" (null), which Llama's template tests by presence.
    call = {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "add", "arguments": {"x": 2}}}]}
    with_tool = [USER, call, {"role": "tool", "content": "4"}, ANSWER]
    pq.write_table(pa.table({"turns": [[USER, ANSWER], [USER, {"role": "assistant", "content": "four " * 100}],
                                       with_tool]}), tmp_path / "c.parquet")
    assert main(["--chat", "--messages-field", "turns", "--input", str(tmp_path / "c.parquet"), "--output",
                 str(tmp_path / "out"), "--tokenizer", str(folders["llama"]), "--max-tokens", "150", "--too-long",
                 "truncate", "--workers", "1", "--no-progress"]) == 0
    ids, masks, index = _read(tmp_path / "out")
    line = capsys.readouterr().out.strip()
    assert line == (f"{tmp_path / 'out'}: {sum(map(len, ids)):,} tokens ({index['sft']['supervised_tokens']:,} "
                    f"supervised, --train-on assistant), 3 conversations in 1 shard(s); 1 truncated to --max-tokens "
                    f"150, 0 dropped (nothing supervised in their first 150 tokens)")
    assert len(ids[1]) == 150 and masks[1][-1] == 1
    renderer = _renderer(folders["llama"])
    for k, conversation in enumerate([[USER, ANSWER], with_tool]):
        expected_ids, expected_mask = renderer.encode([renderer.render(conversation)])[0]
        assert ids[2 * k].tolist() == expected_ids.tolist() and masks[2 * k].tolist() == expected_mask.tolist()
    assert [text for bit, text in _runs(renderer, with_tool) if bit] == [
        '{"name": "add", "parameters": {"x": 2}}<|eot_id|>', "4.<|eot_id|>"]  # the call is the assistant's words


def test_a_text_file_is_not_chat_data(folders, tmp_path):
    (tmp_path / "a.txt").write_text("some prose")
    with pytest.raises(PrepareError, match=r"a.txt: a text file holds documents, not conversations; give JSONL or "
                                           r"Parquet records for --messages-field$"):
        prepare([str(tmp_path / "a.txt")], str(tmp_path / "out"), tokenizer_path=str(folders["qwen"]), workers=1,
                progress=False, chat=ChatOptions(messages_field="messages"))
    assert not (tmp_path / "out").exists()


WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city.",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                           "required": ["city"]}}}
CLOCK = {"type": "function", "function": {"name": "get_time", "description": "The time in a time zone.",
                                          "parameters": {"type": "object", "properties": {"zone": {"type": "string"}}}}}
CALL = {"role": "assistant", "content": None,  # OpenAI's form of a turn that only calls a tool
        "tool_calls": [{"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]}
WITH_TOOLS = {"tools": [WEATHER], "messages": [{"role": "user", "content": "Weather in Paris?"}, CALL,
                                               {"role": "tool", "content": "sunny"},
                                               {"role": "assistant", "content": "It is sunny."}]}


def test_tools_and_tool_calls_render_as_transformers_renders_them(folders):
    """A record's tools reach every render (the whole one and the prefixes that bound the turns:
    Qwen 3 writes them into the system turn, Llama 3.2 into the first user turn); a turn that only
    calls a tool is supervised as the template writes the call, the tool's answer is not."""
    from transformers import AutoTokenizer

    calls = {"qwen": '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>',
             "llama": '{"name": "get_weather", "parameters": {"city": "Paris"}}<|eot_id|>'}
    answers = {"qwen": "<think>\n\n</think>\n\nIt is sunny.<|im_end|>", "llama": "It is sunny.<|eot_id|>"}
    for name in ("qwen", "llama"):
        renderer = _renderer(folders[name])
        messages, tools = renderer.messages(WITH_TOOLS), renderer.tools(WITH_TOOLS)
        text, _ = renderer.render(messages, tools)
        expected = AutoTokenizer.from_pretrained(str(folders[name])).apply_chat_template(
            WITH_TOOLS["messages"], tools=WITH_TOOLS["tools"], tokenize=False, date_string="26 Jul 2024")
        assert text == expected and "The weather in a city." in text
        runs = _runs(renderer, messages, tools)
        assert [piece for bit, piece in runs if bit] == [calls[name], answers[name]]
        assert "sunny" in runs[2][1] and runs[2][0] == 0
        as_string = dict(WITH_TOOLS, tools=json.dumps(WITH_TOOLS["tools"]))  # datasets often store them so
        assert renderer.tools(as_string) == tools and renderer.render(messages, renderer.tools(as_string))[0] == text


def test_bad_tools_and_null_contents_are_bad_records(folders, tmp_path):
    renderer = _renderer(folders["qwen"], tools_field="functions")
    for value, message in [(5, "'functions' is a int, not a list of tool objects"),
                           ("[{]", "'functions' is a string that is not JSON, not a list of tool objects"),
                           ('{"name": "f"}', "'functions' is a JSON string of a dict, not a list of tool objects"),
                           ([WEATHER, "get_time"], "'functions': tool 1 is a str, not an object")]:
        with pytest.raises(BadRecord) as err:
            renderer.tools({"functions": value})
        assert str(err.value) == message
    assert renderer.tools({"functions": None}) is None and renderer.tools({"tools": 5}) is None  # another field
    for message in ({"role": "assistant", "content": None}, {"role": "assistant", "content": None, "tool_calls": []},
                    dict(CALL, role="user")):  # no call to say: a null content is refused as before
        with pytest.raises(BadRecord, match=r"message 1 \((assistant|user)\): content is NoneType, not a string$"):
            renderer.messages({"messages": [USER, message, ANSWER]})
    path = _jsonl(tmp_path / "c.jsonl", [WITH_TOOLS, dict(WITH_TOOLS, tools={"get_weather": WEATHER})])
    with pytest.raises(PrepareError) as err:
        prepare([str(path)], str(tmp_path / "out"), tokenizer_path=str(folders["qwen"]), workers=1, progress=False,
                bad_records="stop", chat=ChatOptions(messages_field="messages"))
    assert str(err.value) == f"{path}:2: 'tools' is a dict, not a list of tool objects (--bad-records stop)"


def test_parquet_tools_as_structs_or_strings_and_files_without_them(folders, tmp_path):
    """Parquet structs give each tool every key any row's tools have (null where it has none):
    rendered as the tools themselves. A file without the tools column reads its conversations (but
    a --tools-field named that no input has is an error: misspelled)."""
    pa = pytest.importorskip("pyarrow", reason="Parquet support is the optional [parquet] extra")
    import pyarrow.parquet as pq

    plain = {"messages": [USER, ANSWER]}
    records = [dict(WITH_TOOLS, fns=[WEATHER]), dict(plain, fns=[CLOCK]), dict(plain, fns=None)]
    pq.write_table(pa.table({"messages": [r["messages"] for r in records], "fns": [r["fns"] for r in records]}),
                   tmp_path / "structs.parquet")
    pq.write_table(pa.table({"messages": [r["messages"] for r in records],
                             "fns": [json.dumps(r["fns"]) if r["fns"] else None for r in records]}),
                   tmp_path / "strings.parquet")
    pq.write_table(pa.table({"messages": [plain["messages"]]}), tmp_path / "none.parquet")
    assert pq.read_table(tmp_path / "structs.parquet").to_pylist()[1]["fns"][0]["function"]["parameters"][
        "properties"] == {"city": None, "zone": {"type": "string"}}  # what the renderer has to undo
    renderer = _renderer(folders["qwen"])
    expected = renderer.encode([renderer.render(renderer.messages(r), r["fns"]) for r in records])
    for name in ("structs", "strings", "none"):
        field = ["--tools-field", "fns"] if name != "none" else []  # the default field, absent: no tools
        assert main(["--chat", *field, "--input", str(tmp_path / f"{name}.parquet"), "--output",
                     str(tmp_path / name), "--tokenizer", str(folders["qwen"]), "--workers", "1",
                     "--no-progress"]) == 0
        ids, masks, _ = _read(tmp_path / name)
        want = expected if name != "none" else expected[2:]
        assert [i.tolist() for i in ids] == [i.tolist() for i, _ in want]
        assert [m.tolist() for m in masks] == [m.tolist() for _, m in want]
    with pytest.raises(PrepareError, match=r"^--tools-field 'fns': no record has this field; the records have: "
                                           r"messages$"):
        main(["--chat", "--tools-field", "fns", "--input", str(tmp_path / "none.parquet"), "--output",
              str(tmp_path / "none-fns"), "--tokenizer", str(folders["qwen"]), "--workers", "1", "--no-progress"])
    assert main(["--chat", "--tools-field", "fns", "--input", str(tmp_path / "none.parquet"), "--input",
                 str(tmp_path / "strings.parquet"), "--output", str(tmp_path / "both"), "--tokenizer",
                 str(folders["qwen"]), "--workers", "1", "--no-progress"]) == 0


def _sharegpt(messages: list[dict]) -> list[dict]:
    """``messages`` as ShareGPT writes them (axolotl's, LLaMA-Factory's, Unsloth's ``conversations``)."""
    names = {"system": "system", "user": "human", "assistant": "gpt", "tool": "tool"}
    return [{"from": names[m["role"]], "value": m["content"]} for m in messages]


def test_sharegpt_conversations_are_the_role_content_conversations_they_stand_for(folders, tmp_path):
    """ShareGPT records (``conversations`` of {from, value}; OpenHermes' "weight": null as Parquet and
    its JSONL give it) prepare to the tokens and masks of the same conversations as {role, content}
    messages, in JSONL and Parquet; an unknown ``from`` is a bad record naming it; the default field
    on ShareGPT data is one line naming the option to give."""
    pa = pytest.importorskip("pyarrow", reason="Parquet support is the optional [parquet] extra")
    import pyarrow.parquet as pq

    chats = [MULTI_TURN, [USER, ANSWER], [USER, {"role": "assistant", "content": "four " * 9}]]
    _jsonl(tmp_path / "plain.jsonl", [{"messages": m} for m in chats])
    shared = [[{**m, "weight": None} for m in _sharegpt(c)] for c in chats]
    (tmp_path / "share").mkdir()
    _jsonl(tmp_path / "share" / "gpt.jsonl", [{"id": str(k), "conversations": c} for k, c in enumerate(shared)])
    pq.write_table(pa.table({"conversations": shared}), tmp_path / "share" / "gpt.parquet")
    options = ChatOptions(messages_field="messages")
    prepare([str(tmp_path / "plain.jsonl")], str(tmp_path / "plain"), tokenizer_path=str(folders["qwen"]),
            workers=1, progress=False, chat=options)
    expected = _read(tmp_path / "plain")
    assert sum(int(m.sum()) for m in expected[1]) > 0
    for name in ("gpt.jsonl", "gpt.parquet"):
        prepare([str(tmp_path / "share" / name)], str(tmp_path / name), tokenizer_path=str(folders["qwen"]),
                workers=1, progress=False, bad_records="stop", chat=ChatOptions(messages_field="conversations"))
        ids, masks, _ = _read(tmp_path / name)
        assert [i.tolist() for i in ids] == [i.tolist() for i in expected[0]], name
        assert [m.tolist() for m in masks] == [m.tolist() for m in expected[1]], name

    odd = [{"from": "human", "value": "Hi"}, {"from": "function_call", "value": "{}"}]
    _jsonl(tmp_path / "odd.jsonl", [{"conversations": shared[1]}, {"conversations": odd}])
    summary = prepare([str(tmp_path / "odd.jsonl")], str(tmp_path / "odd"), tokenizer_path=str(folders["qwen"]),
                      workers=1, progress=False, chat=ChatOptions(messages_field="conversations"))
    assert summary["bad_records"] == 1 and summary["first_bad"] == (
        f"{tmp_path / 'odd.jsonl'}:2: message 1: unknown ShareGPT role (from) 'function_call'; ShareGPT roles: "
        f"system, human, user, gpt, assistant, tool")
    with pytest.raises(PrepareError, match=r"gpt.jsonl:1: no list field 'messages' \(--messages-field\); the record "
                                           r"has: id, conversations; ShareGPT data: --messages-field conversations$"):
        main(["--chat", "--input", str(tmp_path / "share" / "gpt.jsonl"), "--output", str(tmp_path / "x"),
              "--tokenizer", str(folders["qwen"])])
    with pytest.raises(PrepareError, match=r"gpt.parquet: no column 'messages' \(--messages-field\); columns: "
                                           r"conversations; ShareGPT data: --messages-field conversations$"):
        main(["--chat", "--input", str(tmp_path / "share" / "gpt.parquet"), "--output", str(tmp_path / "x"),
              "--tokenizer", str(folders["qwen"])])
    assert not (tmp_path / "x").exists()


@pytest.mark.parametrize("name", ["llama", "qwen"])
def test_trl_s_conversational_prompt_completion_supervises_the_completion_alone(folders, tmp_path, name, monkeypatch):
    """TRL's conversational prompt-completion records (``prompt`` and ``completion`` lists of messages,
    or a text for either) prepare to the tokens of the conversation prompt + completion, with only the
    completion's assistant turns supervised (the prompt's earlier assistant turn is not), as TRL's
    completion-only loss does; --train-on all supervises every token. What cannot be rendered so is a
    bad record naming why."""
    _on_day(monkeypatch, NOW)  # (Llama 3.2 writes today's date: the one the expected renders have)
    prior = {"role": "assistant", "content": "Hello."}
    records = [{"prompt": [SYSTEM, {"role": "user", "content": "Hi."}, prior, USER], "completion": [ANSWER]},
               {"prompt": "What is 2+2?", "completion": [{"role": "assistant", "content": "Let me check."},
                                                        {"role": "tool", "content": "4"}, ANSWER]},
               {"prompt": [USER], "completion": "4."}]
    path = _jsonl(tmp_path / "pc.jsonl", records)
    for train_on in ("assistant", "last_assistant", "all"):
        prepare([str(path)], str(tmp_path / train_on), tokenizer_path=str(folders[name]), workers=1, progress=False,
                bad_records="stop", chat=ChatOptions(prompt_fields=("prompt",), response_field="completion",
                                                     train_on=train_on))
        ids, masks, _ = _read(tmp_path / train_on)
        renderer = _renderer(folders[name], train_on=train_on)
        whole = [records[0]["prompt"] + records[0]["completion"], [USER] + records[1]["completion"], [USER, ANSWER]]
        prompt_turns = [1, 0, 0]
        for k, messages in enumerate(whole):
            text, spans = renderer.render(messages, skip=prompt_turns[k])
            expected_ids, expected_mask = renderer.encode([(text, spans)])[0]
            assert ids[k].tolist() == expected_ids.tolist(), (train_on, k)
            assert masks[k].tolist() == expected_mask.tolist(), (train_on, k)
            supervised = renderer.tokenizer.decode(ids[k][masks[k] == 1].tolist())
            if train_on == "all":  # (but an EOS the encoding appends)
                assert masks[k][:-1].all()
            elif k == 0:  # the prompt's own assistant turn is not supervised, the completion's is
                assert "4." in supervised and "Hello." not in supervised
            elif k == 1:
                assert ("Let me check." in supervised) == (train_on == "assistant") and "4." in supervised

    bad = [{"prompt": [USER], "completion": [{"role": "user", "content": "?"}]}, {"prompt": [], "completion": "4."}]
    _jsonl(tmp_path / "bad.jsonl", [records[2], *bad])
    summary = prepare([str(tmp_path / "bad.jsonl")], str(tmp_path / "bad"), tokenizer_path=str(folders[name]),
                      workers=1, progress=False,
                      chat=ChatOptions(prompt_fields=("prompt",), response_field="completion"))
    assert summary["bad_records"] == 2 and summary["first_bad"] == f"{tmp_path / 'bad.jsonl'}:2: 'completion': no " \
                                                                   f"assistant turn"
    with pytest.raises(PrepareError, match=r"plain.jsonl:1: a tokenizer without a chat template renders a text "
                                           r"prompt and a text response only; give one with --chat-template FILE"):
        prepare([str(_jsonl(tmp_path / "plain.jsonl", records[:1]))], str(tmp_path / "p"), bad_records="stop",
                tokenizer_path=str(folders["plain"]), workers=1, progress=False,
                chat=ChatOptions(prompt_fields=("prompt",), response_field="completion"))
    two = _jsonl(tmp_path / "two.jsonl", [{"system": "x", "prompt": "2+2?", "completion": "4."},
                                          {**records[2], "system": "x"}])
    summary = prepare([str(two)], str(tmp_path / "t"), tokenizer_path=str(folders[name]), workers=1, progress=False,
                      chat=ChatOptions(prompt_fields=("system", "prompt"), response_field="completion"))
    assert summary["bad_records"] == 1 and summary["first_bad"] == (
        f"{two}:2: 'prompt' is a list of messages: a conversational prompt is one field, not 2 (--prompt-field)")
    with pytest.raises(PrepareError, match=r"three.jsonl:1: field 'prompt' \(--prompt-field\) is a list, not text$"):
        prepare([str(_jsonl(tmp_path / "three.jsonl", [{**records[2], "system": "x"}]))], str(tmp_path / "3"),
                tokenizer_path=str(folders[name]), workers=1, progress=False,
                chat=ChatOptions(prompt_fields=("system", "prompt"), response_field="completion"))


def test_a_json_file_holding_one_array_of_records_reads_as_its_records(folders, tmp_path):
    """A ``.json`` file that is one JSON array (Alpaca's alpaca_data.json, ShareGPT dumps; pretty
    printed, as they are published) prepares to what the same records as JSONL give: chat, pairs and
    text; an element that is not a record is a bad record named by its index; an empty array, or one
    whose first record lacks the field, is one line before any work."""
    alpaca = [{"instruction": "Add the numbers.", "input": "2 and 2", "output": "4"}, "not a record",
              {"instruction": "Say hi. " * 3000, "input": "", "output": "hi"}]  # (longer than the first read)
    shared = [{"conversations": _sharegpt(c)} for c in (MULTI_TURN, [USER, ANSWER])]
    cases = {"alpaca": (alpaca, ChatOptions(prompt_fields=("instruction", "input"), response_field="output")),
             "sharegpt": (shared, ChatOptions(messages_field="conversations")),
             "text": ([{"text": "one document"}, {"text": "another " * 10}], None)}
    for name, (records, options) in cases.items():
        outputs = []
        for kind in ("jsonl", "json"):
            path = tmp_path / f"{name}.{kind}"
            if kind == "json":
                path.write_text(" \n" + json.dumps(records, indent=2))
            else:
                _jsonl(path, records)
            summary = prepare([str(path)], str(tmp_path / f"{name}-{kind}"), tokenizer_path=str(folders["qwen"]),
                              workers=2, progress=False, chat=options)
            out = tmp_path / f"{name}-{kind}"
            outputs.append((_read(out) if options else [(out / f"{s['name']}.tokens").read_bytes() for s in
                                                        json.loads((out / "index.json").read_text())["shards"]],
                            summary))
        (jsonl, jsonl_summary), (array, array_summary) = outputs
        if options is not None:
            assert [i.tolist() for i in array[0]] == [i.tolist() for i in jsonl[0]] and len(array[0]) == 2, name
            assert [m.tolist() for m in array[1]] == [m.tolist() for m in jsonl[1]], name
        else:
            assert array == jsonl and array_summary["documents"] == 2
        assert array_summary["bad_records"] == jsonl_summary["bad_records"] == (name == "alpaca"), name
    assert array_summary["bad_records"] == 0
    assert outputs and prepare_module.file_kind(tmp_path / "alpaca.json") == "json"
    assert prepare([str(tmp_path / "alpaca.json")], str(tmp_path / "again"), tokenizer_path=str(folders["qwen"]),
                   workers=1, progress=False, chat=cases["alpaca"][1])["first_bad"] == (
        f"{tmp_path / 'alpaca.json'}: element 1: not an object but a str")

    (tmp_path / "empty.json").write_text("[\n]\n")
    (tmp_path / "other.json").write_text(json.dumps([{"prompt": "2+2?", "answer": "4"}], indent=2))
    for path, message in ((tmp_path / "empty.json", r"empty.json: an empty JSON array$"),
                          (tmp_path / "other.json", r"other.json: element 0: no text or list field 'output' "
                                                    r"\(--response-field\); the record has: prompt, answer$")):
        with pytest.raises(PrepareError, match=message):
            prepare([str(path)], str(tmp_path / "out"), tokenizer_path=str(folders["qwen"]), workers=1,
                    progress=False, chat=ChatOptions(prompt_fields=("prompt",), response_field="output"))
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("template", ["llama", "qwen", "markers"])
def test_an_assistant_turn_of_weight_0_is_context_not_supervised(folders, tmp_path, template, monkeypatch):
    """OpenAI's fine-tuning format (and ShareGPT's) weighs assistant turns: ``"weight": 0`` leaves a
    turn unsupervised (its tokens stay in the conversation), 1 or none supervises it; the text is the
    same. A weight that is not 0 or 1, or a conversation left with nothing to train on, is a bad record."""
    folder = folders["llama" if template == "llama" else "qwen"]
    marked = (TEMPLATES / "chatml_generation.jinja").read_text() if template == "markers" else None
    renderer = _renderer(folder, marked)
    weighted = [SYSTEM, USER, {**ANSWER, "weight": 0}, {"role": "user", "content": "Weather?"},
                {"role": "assistant", "content": "It is sunny.", "weight": 1}]
    plain = [{k: v for k, v in m.items() if k != "weight"} for m in weighted]
    text, spans = renderer.render(plain)
    assert renderer.render(weighted) == (text, spans[1:])
    assert [piece for bit, piece in _runs(renderer, weighted) if bit] == [
        piece for bit, piece in _runs(renderer, plain) if bit][1:]
    assert "It is sunny." in text[spans[1][0]:spans[1][1]]

    _on_day(monkeypatch, NOW)
    records = [{"messages": weighted}, {"messages": [USER, {**ANSWER, "weight": 0}]},
               {"messages": [USER, {**ANSWER, "weight": 2}]},
               {"conversations": [{"from": "human", "value": "Hi."}, {"from": "gpt", "value": "Hello.", "weight": 0},
                                  {"from": "human", "value": "2+2?"}, {"from": "gpt", "value": "4.", "weight": 1}]}]
    records[3] = {"messages": records[3]["conversations"]}
    path = _jsonl(tmp_path / "w.jsonl", records)
    template_file = tmp_path / "t.jinja"
    template_file.write_text(marked or "")
    options = ChatOptions(messages_field="messages", template=str(template_file) if marked else None)
    summary = prepare([str(path)], str(tmp_path / "out"), tokenizer_path=str(folder), workers=1, progress=False,
                      chat=options)
    assert summary["bad_records"] == 2 and summary["first_bad"] == f"{path}:2: every assistant turn it would train " \
                                                                   f"on has weight 0"
    ids, masks, _ = _read(tmp_path / "out")
    expected = renderer.encode([renderer.render(weighted)])[0]
    assert ids[0].tolist() == expected[0].tolist() and masks[0].tolist() == expected[1].tolist()
    supervised = renderer.tokenizer.decode(ids[1][masks[1] == 1].tolist())
    assert "4." in supervised and "Hello." not in supervised
    with pytest.raises(PrepareError, match=r"two.jsonl:2: message 1: weight 2; a turn's weight is 0 \(not trained "
                                           r"on\) or 1 \(--bad-records stop\)$"):
        prepare([str(_jsonl(tmp_path / "two.jsonl", [records[0], records[2]]))], str(tmp_path / "stop"),
                tokenizer_path=str(folder), workers=1, progress=False, chat=options, bad_records="stop")
