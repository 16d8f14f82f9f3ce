"""``titan-lightning prepare --chat`` throughput: conversations/s and tokens/s, next to the
tokenizers library alone encoding the same rendered text.

    python -m benchmarks.prepare_chat --conversations 200000 --workers 1,2 --template qwen3 --repeat 1
    python -m benchmarks.prepare_chat --conversations 2000 --workers 1,16 --progress   # ~10 MB, one file

Synthetic conversations of a realistic length mix (the shipped corpus's words): a system prompt
in half of them, 1-4 user/assistant exchanges, short turns (5-60 words) and, one time in five, a
long one (200-800 words); a tool turn in one conversation in ten. The tokenizer is the shipped
byte-level BPE with the template's special tokens added; the template is one of
tests/assets/chat_templates (qwen3: no {% generation %} markers, so prefix renders per assistant
turn; chatml_generation: one render per conversation; llama3.2).

The baseline renders every conversation once (untimed) and times ``Tokenizer.encode_batch`` on
that text in batches of 256 (as prepare batches), on all cores: what prepare costs above it is
reading the JSONL, rendering, the masks and writing the shards. Wall time and CPU time (this
process and its worker processes) are both shown: on a shared machine the CPU time is the steadier.
The data is one JSONL file: with several workers prepare cuts it into pieces that they share.
``--progress`` prints prepare's progress lines (as in a log, one a second) on stderr.
"""

import argparse
import json
import os
import random
import shutil
import statistics
import tempfile
import time
from pathlib import Path

TEMPLATES = Path(__file__).resolve().parents[1] / "tests" / "assets" / "chat_templates"
SPECIALS = {"qwen3": ["<|im_start|>", "<|im_end|>"], "chatml_generation": ["<|im_start|>", "<|im_end|>"],
            "llama3.2": ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]}
CONFIG = {"qwen3": {"eos_token": "<|im_end|>"}, "chatml_generation": {"eos_token": "<|im_end|>"},
          "llama3.2": {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"}}


def tokenizer_folder(folder: Path, template: str) -> Path:
    from tokenizers import AddedToken, Tokenizer

    from titan_lightning.data.tokenizer import TOKENIZER_PATH

    folder.mkdir(parents=True)
    tokenizer = Tokenizer.from_file(str(TOKENIZER_PATH))
    tokenizer.add_special_tokens([AddedToken(t, special=True) for t in SPECIALS[template]])
    tokenizer.save(str(folder / "tokenizer.json"))
    config = dict(CONFIG[template], chat_template=(TEMPLATES / f"{template}.jinja").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


def conversations(n: int, seed: int = 0):
    from titan_lightning.data.tokenizer import reference_documents

    words = " ".join(reference_documents()).split()
    rng = random.Random(seed)

    def text() -> str:
        length = rng.randint(200, 800) if rng.random() < 0.2 else rng.randint(5, 60)
        start = rng.randrange(len(words) - length)
        return " ".join(words[start:start + length])

    for _ in range(n):
        messages = [{"role": "system", "content": text()}] if rng.random() < 0.5 else []
        for turn in range(rng.randint(1, 4)):
            messages.append({"role": "user", "content": text()})
            if rng.random() < 0.1:
                messages += [{"role": "assistant", "content": text()}, {"role": "tool", "content": text()}]
            messages.append({"role": "assistant", "content": text()})
        yield {"messages": messages}


def timed(function):
    """(its result, wall seconds, CPU seconds of this process and its finished children)."""
    before, start = os.times(), time.perf_counter()
    result = function()
    wall, after = time.perf_counter() - start, os.times()
    cpu = sum(after[:4]) - sum(before[:4])
    return result, wall, cpu


def main() -> None:
    from titan_lightning.data import prepare as prepare_module
    from titan_lightning.data.chat import ChatOptions, ChatRenderer, resolve
    from titan_lightning.data.prepare import prepare
    from titan_lightning.data.tokenizer import load_tokenizer

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--conversations", type=int, default=200_000)
    parser.add_argument("--workers", default="1,2")
    parser.add_argument("--template", default="qwen3", choices=sorted(SPECIALS))
    parser.add_argument("--repeat", type=int, default=1, help="rounds of every row, interleaved; medians shown")
    parser.add_argument("--progress", action="store_true", help="prepare's progress lines on stderr, one a second")
    args = parser.parse_args()
    prepare_module.LOG_EVERY_S = 1.0
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        folder = tokenizer_folder(root / "tokenizer", args.template)
        data = root / "chats.jsonl"
        with data.open("w") as f:
            for record in conversations(args.conversations):
                f.write(json.dumps(record) + "\n")
        options = ChatOptions(messages_field="messages")
        tokenizer = load_tokenizer(str(folder))
        renderer = ChatRenderer(resolve(options, str(folder)), tokenizer)
        records = [json.loads(line) for line in data.open()]
        rendered, render_s, _ = timed(lambda: [renderer.render(r["messages"]) for r in records])
        texts = [t for t, _ in rendered]
        del rendered, records

        def alone() -> int:
            return sum(len(ids) for k in range(0, len(texts), 256) for ids in tokenizer.encode_batch(texts[k:k + 256]))

        def prepared(workers: int) -> int:
            out = root / f"out{workers}"
            summary = prepare([str(data)], str(out), tokenizer_path=str(folder), workers=workers,
                              progress=args.progress, chat=options)
            shutil.rmtree(out)
            return summary["tokens"]

        rows = {"tokenizers alone (encode_batch, all cores)": alone,
                **{f"prepare --chat, {w} worker(s)": (lambda w=w: prepared(w)) for w in map(int, args.workers.split(","))}}
        times: dict[str, list] = {name: [] for name in rows}
        tokens = {}
        for _ in range(args.repeat):
            for name, run in rows.items():
                tokens[name], wall, cpu = timed(run)
                times[name].append((wall, cpu))
        print(f"{args.conversations:,} conversations ({data.stat().st_size / 2**20:.0f} MiB of JSONL), "
              f"{tokens[next(iter(rows))]:,} tokens, template {args.template}; rendering alone (one core): "
              f"{args.conversations / render_s:,.0f} conversations/s; medians of {args.repeat}")
        print("| what | wall s | CPU s | conversations/s | tokens/s | tokens per CPU-s | vs alone (wall) | "
              "vs alone (CPU) |")
        print("|---|---|---|---|---|---|---|---|")
        base_wall, base_cpu = (statistics.median(x) for x in zip(*times[next(iter(rows))]))
        for name in rows:
            wall, cpu = (statistics.median(x) for x in zip(*times[name]))
            print(f"| {name} | {wall:.1f} | {cpu:.1f} | {args.conversations / wall:,.0f} | {tokens[name] / wall:,.0f} | "
                  f"{tokens[name] / cpu:,.0f} | {base_wall / wall:.2f}x | {base_cpu / cpu:.2f}x |")


if __name__ == "__main__":
    main()
