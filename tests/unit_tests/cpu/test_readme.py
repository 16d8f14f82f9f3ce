"""The README's runnable blocks, run as the README writes them.

A fenced block right after the line ``<!-- test: NAME -->`` is runnable: ``RUNNABLE[NAME]`` says how
this file runs it, and nothing else is changed. Its ``substitutions`` replace README paths
(``path/to/hf-folder/``, ``runs/hf_sft/<time>/export_hf``) with tiny fixtures; each must occur in
the block, so a block that stops naming a path fails here instead of drifting. ``append`` adds
arguments to every command (a short ``--trainer.max_steps``), and ``skip`` names, by their first
words, the commands that are not run here (each must occur too). Shell blocks run their
``titan-lightning`` commands: ``fit`` on as many gloo ranks as ``--trainer.devices`` says, the others
in this process; Python blocks are executed. A marked block without an entry here, or an entry
whose block is gone, fails ``test_every_marked_block_is_run_here``.

The Fine-tuning path (prepare --chat -> fit recipes.hf:sft on 2 ranks -> chat / generate on the run,
the folder and its checkpoint -> transformers on the export) runs on a tiny Qwen 3 folder with a
ChatML template and sampling settings, and checks what the README promises: the loss goes down, and
the export holds our logits, the trained weights, the chat template and the generation settings.
Cost on 2 CPU cores: the marker checks well under a second; the Quickstart's debug fit ~14 s; the
Fine-tuning path ~17 s (51 steps of 3 epochs on 2 ranks, then chat, generate and transformers), both
marked slow (end-to-end runs).
"""

import contextlib
import io
import json
import random
import re
import shlex
import shutil
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

from titan_lightning.testing.launch import launch
from titan_lightning.trainer import RUN_DIR_ENV

from tests.hf_folders import VOCAB, assert_transformers_agrees, load_ours, save_hf_folder

README = Path(__file__).parents[3] / "README.md"
MARKER = re.compile(r"^<!-- test: (?P<name>[\w-]+) -->\n(?P<fence>```(?P<lang>\w*)\n(?P<code>.*?)^```$)?", re.M | re.S)


@dataclass(frozen=True, kw_only=True)
class Runnable:
    """How one marked block runs here: ``substitutions`` (README text -> the name of a fixture path;
    one pass, the longest text first), ``append`` (arguments added to every command), ``skip`` (commands not run, by
    their first words), ``stdin`` (what the commands read: a chat's user turns)."""

    substitutions: dict[str, str] = field(default_factory=dict)
    append: tuple[str, ...] = ()
    skip: tuple[str, ...] = ()
    stdin: str = ""


RUNNABLE = {
    # The install line and the full suite are what CI itself runs; the debug fit runs 2 steps.
    "quickstart": Runnable(append=("--trainer.max_steps", "2"), skip=("pip install", "pytest")),
    "sft-prepare": Runnable(substitutions={"chats.jsonl": "chats", "path/to/hf-folder/": "folder",
                                           "sft-shards/": "shards"}),
    "sft-fit": Runnable(substitutions={"path/to/hf-folder/": "folder", "sft-shards/": "shards"}),
    "sft-try": Runnable(substitutions={"runs/hf_sft/<time>/checkpoints/epoch=0-step=500.ckpt": "checkpoint",
                                       "runs/hf_sft/": "runs", "path/to/hf-folder/": "folder", "sft-shards/": "shards"},
                        stdin="What is 2+2?\n"),
    "sft-use": Runnable(substitutions={"runs/hf_sft/<time>/export_hf": "export"}),
}
FIT_COMMANDS = ("fit", "validate", "test")  # run on their ranks by the launcher; the others in this process
TIMEOUT_S = 300


def marked_blocks(text: str) -> dict[str, tuple[str, str]]:
    """NAME -> (language, code) of every block the README marks runnable."""
    blocks = {}
    for match in MARKER.finditer(text):
        name = match["name"]
        assert match["fence"], f"README: <!-- test: {name} --> must be followed directly by a fenced block"
        assert name not in blocks, f"README: two blocks are marked <!-- test: {name} -->"
        blocks[name] = (match["lang"], match["code"])
    return blocks


def substituted(name: str, code: str, paths: dict[str, Path]) -> str:
    """The block with each substitution's README text replaced by its fixture's path (one pass, the
    longest text first; a text ending in / keeps it); without ``paths``, only checked."""
    texts = RUNNABLE[name].substitutions
    for text in texts:
        assert text in code, (f"README block <!-- test: {name} --> no longer contains {text!r}: update "
                              f"RUNNABLE[{name!r}] in {Path(__file__).name}")
    if not paths or not texts:
        return code
    pattern = re.compile("|".join(re.escape(text) for text in sorted(texts, key=len, reverse=True)))
    return pattern.sub(lambda m: str(paths[texts[m[0]]]) + ("/" if m[0].endswith("/") else ""), code)


def commands(name: str, code: str) -> list[list[str]]:
    """The block's ``titan-lightning`` commands as argv lists (continuation lines joined, comments
    dropped), ``append`` added; a command neither ``titan-lightning`` nor skipped fails."""
    runnable, argvs, skipped = RUNNABLE[name], [], set()
    for line in code.replace("\\\n", " ").splitlines():
        argv = shlex.split(line, comments=True)
        if not argv:
            continue
        words = " ".join(argv)
        skip = next((s for s in runnable.skip if words.startswith(s)), None)
        if skip is not None:
            skipped.add(skip)
            continue
        assert argv[0] == "titan-lightning", (f"README block <!-- test: {name} -->: {line.strip()!r} is neither a "
                                             f"titan-lightning command nor in RUNNABLE[{name!r}].skip")
        argvs.append(argv[1:] + list(runnable.append))
    missing = set(runnable.skip) - skipped
    assert not missing, f"README block <!-- test: {name} --> no longer has {sorted(missing)}: update RUNNABLE[{name!r}]"
    return argvs


def devices(argv: list[str]) -> int:
    for i, arg in enumerate(argv):
        if arg == "--trainer.devices":
            return int(argv[i + 1])
        if arg.startswith("--trainer.devices="):
            return int(arg.split("=", 1)[1])
    return 1


def run_block(name: str, paths: dict[str, Path], out: Path) -> str:
    """Run the README's block ``name`` with its substitutions; what a Python block printed."""
    lang, code = marked_blocks(README.read_text())[name]
    code = substituted(name, code, paths)
    if lang == "python":
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):
            exec(compile(code, f"README <!-- test: {name} -->", "exec"), {})
        return printed.getvalue()
    assert lang in ("bash", "sh"), f"README block <!-- test: {name} -->: no runner for ```{lang}"
    from titan_lightning.cli import main

    for argv in commands(name, code):
        if argv[0] in FIT_COMMANDS:
            launch(argv, devices(argv), out_dir=out / name, timeout=TIMEOUT_S, env={RUN_DIR_ENV: str(paths["run"])})
        else:
            with contextlib.redirect_stdout(io.StringIO()), _stdin(RUNNABLE[name].stdin):
                status = main(argv)
            assert status == 0, f"README block <!-- test: {name} -->: titan-lightning {shlex.join(argv)} exited {status}"
    return ""


@contextlib.contextmanager
def _stdin(text: str):
    saved, sys.stdin = sys.stdin, io.StringIO(text)
    try:
        yield
    finally:
        sys.stdin = saved


def test_every_marked_block_is_run_here():
    """Cheap, and run first: every marked block has its entry, its substitutions and skips still
    match, its shell lines are titan-lightning commands and its Python compiles."""
    blocks = marked_blocks(README.read_text())
    assert set(blocks) == set(RUNNABLE), (f"marked in README but not run here: {sorted(set(blocks) - set(RUNNABLE))}; "
                                          f"run here but no longer marked: {sorted(set(RUNNABLE) - set(blocks))}")
    for name, (lang, code) in blocks.items():
        code = substituted(name, code, {})
        if lang == "python":
            compile(code, name, "exec")
        else:
            assert commands(name, code), f"README block <!-- test: {name} --> runs no titan-lightning command"


def test_a_block_that_drifts_from_its_substitutions_fails():
    RUNNABLE["drifted"] = Runnable(substitutions={"path/to/hf-folder/": "folder"}, skip=("pip install",))
    try:
        with pytest.raises(AssertionError, match=r"no longer contains 'path/to/hf-folder/'"):
            substituted("drifted", "titan-lightning fit --recipe recipes.hf:sft --job.data.dataset_path data/", {})
        with pytest.raises(AssertionError, match=r"no longer has \['pip install'\]"):
            commands("drifted", "titan-lightning fit --recipe recipes.llama3:debugmodel")
        with pytest.raises(AssertionError, match="neither a titan-lightning command"):
            commands("drifted", "pip install -e .\nrm -rf runs")
    finally:
        del RUNNABLE["drifted"]
    assert marked_blocks("<!-- test: x -->\n```bash\ntitan-lightning fit \\\n  --recipe r:f  # c\n```\n") == \
        {"x": ("bash", "titan-lightning fit \\\n  --recipe r:f  # c\n")}
    with pytest.raises(AssertionError, match="must be followed directly by a fenced block"):
        marked_blocks("<!-- test: x -->\n\n```bash\ntitan-lightning fit\n```\n")


@pytest.mark.slow  # an end-to-end run
@pytest.mark.multi_process
def test_quickstart_debug_run(tmp_path):
    run_block("quickstart", {"run": tmp_path / "run"}, tmp_path)
    assert (tmp_path / "quickstart" / "rank0.json").is_file()
    assert len(json.loads((tmp_path / "quickstart" / "rank0.json").read_text())["losses"]) == 2


# -- the Fine-tuning path --------------------------------------------------------------------

TEMPLATE = Path(__file__).parents[2] / "assets" / "chat_templates" / "qwen3.jinja"
GENERATION = {"do_sample": True, "temperature": 0.7, "top_p": 0.8, "top_k": 20}


def chat_folder(folder: Path) -> Path:
    """A Qwen 3 folder as an instruct checkpoint ships: ChatML special tokens, chat_template.jinja,
    sampling settings and the end-of-turn id among the EOS ids of generation_config.json; 128
    positions, so that every conversation of ``conversations`` fits one window."""
    from tokenizers import AddedToken, Tokenizer

    save_hf_folder(folder, "qwen3", max_position_embeddings=128)
    tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
    tokenizer.add_special_tokens([AddedToken(t, special=True) for t in ("<|im_start|>", "<|im_end|>")])
    tokenizer.save(str(folder / "tokenizer.json"))
    shutil.copy(TEMPLATE, folder / "chat_template.jinja")
    eos = [tokenizer.token_to_id("<|im_end|>"), tokenizer.token_to_id("<|endoftext|>")]
    (folder / "generation_config.json").write_text(json.dumps({**GENERATION, "eos_token_id": eos}))
    return folder


def conversations(path: Path, n: int = 24) -> Path:
    """``n`` short chats (a system turn in every second one, one or two exchanges): few windows per
    epoch on 2 ranks, and at least the 20 conversations from which recipes.hf:sft holds some out (a
    held-out window for one of the 2 ranks: the other validates a filler, as on any small set)."""
    words = "the model learns to answer short questions about numbers and colors with one word".split()
    rng = random.Random(0)
    with path.open("w") as f:
        for i in range(n):
            turns = [{"role": "system", "content": "Be brief."}] if i % 2 else []
            for _ in range(1 + i % 2):
                turns += [{"role": "user", "content": " ".join(rng.choices(words, k=3)) + "?"},
                          {"role": "assistant", "content": " ".join(rng.choices(words, k=2)) + "."}]
            f.write(json.dumps({"messages": turns}) + "\n")
    return path


@pytest.mark.slow  # an end-to-end run
@pytest.mark.multi_process
def test_fine_tuning_as_the_readme_walks_it(tmp_path):
    transformers = pytest.importorskip("transformers", reason="the Use-the-result step; a test-only extra")
    runs = tmp_path / "runs" / "hf_sft"  # the recipe's runs: one, its folder named as a time would be
    paths = {"folder": chat_folder(tmp_path / "hf"), "chats": conversations(tmp_path / "chats.jsonl"),
             "shards": tmp_path / "sft", "runs": runs, "run": runs / "20261204-120000-000000"}
    paths["export"] = paths["run"] / "export_hf"
    folder, export = paths["folder"], paths["export"]

    run_block("sft-prepare", paths, tmp_path)
    index = json.loads((paths["shards"] / "index.json").read_text())
    assert index["loss_mask"] and index["sft"]["conversations"] == 24

    run_block("sft-fit", paths, tmp_path)
    ranks = [json.loads((tmp_path / "sft-fit" / f"rank{r}.json").read_text()) for r in range(2)]
    losses = ranks[0]["losses"]
    assert all(rank["losses"] == losses for rank in ranks)  # the step's mean
    assert len(losses) > 3 and max(losses[-3:]) < min(losses[:3])  # it learns
    paths["checkpoint"] = max((paths["run"] / "checkpoints").glob("*.ckpt"), key=lambda p: p.stat().st_mtime)

    run_block("sft-try", paths, tmp_path)  # chat on the run, generate on the folder, chat on the checkpoint

    torch.manual_seed(0)  # the export samples (its generation_config.json)
    answer = run_block("sft-use", paths, tmp_path)
    assert answer.endswith("\n") and "What is 2+2?" not in answer  # the new tokens only

    tokens = torch.randint(0, VOCAB, (2, 32), generator=torch.Generator().manual_seed(0))
    theirs = assert_transformers_agrees(export, load_ours(export), tokens, rtol=0, atol=1e-5)
    initial = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    assert not torch.equal(theirs.model.layers[0].mlp.down_proj.weight, initial.model.layers[0].mlp.down_proj.weight)

    tokenizer = transformers.AutoTokenizer.from_pretrained(export)
    assert tokenizer.chat_template == TEMPLATE.read_text()
    chat = [{"role": "user", "content": "colors?"}]
    assert tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True) == \
        transformers.AutoTokenizer.from_pretrained(folder).apply_chat_template(chat, tokenize=False,
                                                                               add_generation_prompt=True)
    generation = transformers.GenerationConfig.from_pretrained(export)
    for key, value in GENERATION.items():
        assert getattr(generation, key) == value, key
    assert tokenizer.convert_tokens_to_ids("<|im_end|>") in generation.eos_token_id
