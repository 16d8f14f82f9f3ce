"""prepare --preference bounds only the answers' assistant turns (data/chat.py ChatRenderer.render's
``skip``): the shards it writes hold, id for id and mask bit for mask bit, what rendering each whole
conversation and dropping the prompt's own turns gives (the path before, issue #49), for templates
that bound a turn by generation prompt, by end-of-turn token, by prefix renders, or by markers."""

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from tests.hf_folders import train_tokenizer
from titan_lightning.data.chat import BadRecord, resolve
from titan_lightning.data.prepare import main as prepare_main
from titan_lightning.data.preference import PreferenceOptions, PreferenceRenderer
from titan_lightning.data.shards import ShardSet
from titan_lightning.data.tokenizer import load_tokenizer

TEMPLATES = Path(__file__).resolve().parents[2] / "assets" / "chat_templates"
SYSTEM = {"role": "system", "content": "Answer briefly."}
TURNS = [{"role": "user", "content": "Hi there"}, {"role": "assistant", "content": "Hello! What can I do?"},
         {"role": "user", "content": "Name two colours"}, {"role": "assistant", "content": "Red and blue."},
         {"role": "user", "content": "And a third?"}]
# Explicit prompts (text; messages with earlier assistant turns, answers found earlier in them; answers of two
# turns) and implicit ones.
RECORDS = [
    {"prompt": "What is two plus two?", "chosen": "Four.", "rejected": "Five, or maybe six."},
    {"prompt": [SYSTEM, *TURNS], "chosen": [{"role": "assistant", "content": "Green."}],
     "rejected": [{"role": "assistant", "content": "No more colours today, sorry."}]},
    {"prompt": [SYSTEM, *TURNS], "chosen": [{"role": "assistant", "content": "Red and blue."}],  # said before
     "rejected": [{"role": "assistant", "content": "Hello! What can I do?"}]},
    {"prompt": [SYSTEM, *TURNS[:4]], "chosen": [TURNS[4], TURNS[3], TURNS[2], TURNS[3]],  # Mistral's: found after
     "rejected": [TURNS[4], {"role": "assistant", "content": "Red and blue."}]},      # the turn before it
    {"prompt": TURNS[:1], "chosen": [TURNS[1], TURNS[2], {"role": "assistant", "content": "Red, blue."}],
     "rejected": [{"role": "assistant", "content": "Go away."}]},
    {"chosen": [SYSTEM, *TURNS, {"role": "assistant", "content": "Yellow, like the sun."}],
     "rejected": [SYSTEM, *TURNS, {"role": "assistant", "content": "Blue again."}]},
    {"chosen": [*TURNS[:2], TURNS[2], {"role": "assistant", "content": "Red."}],
     "rejected": [*TURNS[:2], {"role": "user", "content": "Bye"}, {"role": "assistant", "content": "Bye!"}]},
]


@pytest.fixture(scope="module")
def tokenizer_folder(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("tokenizer")
    train_tokenizer(folder, "qwen2")
    return folder


@pytest.mark.parametrize("template", ["qwen3", "mistral_v0.3_like", "llama3.2", "chatml_generation"])
def test_prepared_pairs_are_the_whole_conversations_rendered_with_the_prompt_s_turns_dropped(
        template, tokenizer_folder, tmp_path):
    folder = tmp_path / "tokenizer"
    shutil.copytree(tokenizer_folder, folder)
    shutil.copy(TEMPLATES / f"{template}.jinja", folder / "chat_template.jinja")
    (tmp_path / "pairs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in RECORDS))
    prepare_main(["--preference", "--input", str(tmp_path / "pairs.jsonl"), "--tokenizer", str(folder),
                  "--output", str(tmp_path / "shards"), "--workers", "1", "--no-progress"])
    shards = ShardSet(tmp_path / "shards")
    ends = shards.document_ends().tolist()
    got = [(shards.read(a, b), shards.read_mask(a, b)) for a, b in zip([0, *ends[:-1]], ends)]

    renderer = PreferenceRenderer(resolve(PreferenceOptions(), str(folder)), load_tokenizer(str(folder)))
    rendered = []
    for record in RECORDS:  # the path before: every assistant turn bounded, the prompt's then dropped
        chosen, rejected, shared = renderer.pair(record)
        prior = sum(m["role"] == "assistant" for m in chosen[:shared])
        for messages in (chosen, rejected):
            text, spans = renderer.render(messages)
            rendered.append((text, spans[prior:]))
    want = renderer.encode(rendered)
    assert shards.index["sft"]["pairs"] == len(RECORDS) and len(got) == len(want)
    for (ids, mask), (want_ids, want_mask) in zip(got, want):
        assert ids.tolist() == want_ids.tolist() and mask.tolist() == want_mask.tolist()
        assert mask.any()


def test_published_layouts_give_each_prompt_once(tokenizer_folder, tmp_path):
    """A text prompt beside whole conversations (ultrafeedback_binarized), a message prompt the answers repeat,
    and hh-rlhf's texts with the prompt inside: each answer is the prompt once, then its own turns."""
    folder = tmp_path / "tokenizer"
    shutil.copytree(tokenizer_folder, folder)
    shutil.copy(TEMPLATES / "qwen3.jinja", folder / "chat_template.jinja")
    renderer = PreferenceRenderer(resolve(PreferenceOptions(), str(folder)), load_tokenizer(str(folder)))
    question = {"role": "user", "content": "What colour is the sky?"}
    blue, green = {"role": "assistant", "content": "Blue."}, {"role": "assistant", "content": "Green."}
    want = ([question, blue], [question, green], 1)
    assert renderer.pair({"prompt": question["content"], "chosen": [question, blue],
                          "rejected": [question, green]}) == want
    assert renderer.pair({"prompt": [question], "chosen": [question, blue], "rejected": [question, green]}) == want
    assert renderer.pair({"prompt": question["content"], "chosen": [blue], "rejected": [green]}) == want
    assert renderer.pair({"prompt": question["content"], "chosen": [SYSTEM, question, blue],  # implicit, as TRL
                          "rejected": [SYSTEM, question, green]}) == ([SYSTEM, question, blue],
                                                                      [SYSTEM, question, green], 2)
    hh = "\n\nHuman: What colour is the sky?\n\nAssistant:"
    assert renderer.pair({"chosen": hh + " Blue, mostly.", "rejected": hh + " Bright green."}) == (
        [{"role": "user", "content": hh}, {"role": "assistant", "content": " Blue, mostly."}],
        [{"role": "user", "content": hh}, {"role": "assistant", "content": " Bright green."}], 1)
    text, spans = renderer.render_pair({"prompt": question["content"], "chosen": [question, blue],
                                        "rejected": [question, green]})[0]
    assert text.count(question["content"]) == 1 and [text[a:b] for a, b in spans][0].endswith("Blue.<|im_end|>\n")
    for record, message in [({"chosen": "Same start. Blue", "rejected": "Other start"}, "sharing no prompt"),
                            ({"chosen": 3, "rejected": "x"}, "not both conversations")]:
        with pytest.raises(BadRecord, match=message):
            renderer.pair(record)
