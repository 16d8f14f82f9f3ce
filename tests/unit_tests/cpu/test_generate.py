"""``titan-lightning generate`` / ``chat`` (titan_lightning/generate.py): our decoder with its KV
cache picks, token for token, what transformers' greedy ``generate`` picks on the same folder, for
each kind of attention (dense, MoE, sliding window, sinks); sampling follows generation_config.json
and the flags; chat renders the conversation with the folder's template, keeps it, and stops at the
end-of-turn id; a checkpoint generates with its run's job; bad input is one line, exit 2."""

import dataclasses
import io
import json
import shutil
import warnings

import pytest
import torch

from titan_lightning import cli
from titan_lightning.generate import (GenerateError, Sampling, Session, build_parser, chat_template, find_model,
                                      generate_tokens, prompt_ids, read_sampling)

from tests.hf_folders import save_hf_folder, save_hf_model

transformers = pytest.importorskip("transformers", reason="the reference implementation; a test-only extra")

PROMPT = [17, 42, 101, 7, 230, 64, 5, 99, 150, 33, 12, 280]  # 12 ids: 44 positions with the 32 new ones
NEW = 32
CHATML = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def greedy(model, prompt, n=NEW, eos=()):
    with Session(model) as session:
        return list(generate_tokens(session, prompt, Sampling(max_new_tokens=n, eos_ids=frozenset(eos))))


# Dense (QK-norm), MoE, sliding window (8 of 44 positions, every layer), sinks (with sliding and
# full layers, YaRN, MoE), and Gemma 3's two RoPE tables with a window of 6.
@pytest.mark.parametrize("model_type, overrides", [
    ("qwen3", {}), ("qwen3_moe", {}), ("mistral", {"sliding_window": 8}), ("gpt_oss", {}), ("gemma3_text", {}),
])
def test_greedy_tokens_are_transformers(tmp_path, model_type, overrides):
    reference = save_hf_model(tmp_path, model_type, **overrides)
    with torch.no_grad():
        out = reference.generate(torch.tensor([PROMPT]), max_new_tokens=NEW, do_sample=False, eos_token_id=None,
                                 pad_token_id=0)
    theirs = out[0, len(PROMPT):].tolist()
    model = find_model(str(tmp_path)).load(torch.device("cpu"), torch.float32)
    with Session(model) as session:
        assert session.attentions is not None  # decoded with the cache, one token per step
        ours = list(generate_tokens(session, PROMPT, Sampling(max_new_tokens=NEW)))
    assert len(set(theirs)) > 4  # not a token repeated: the cache's keys and positions matter
    assert ours == theirs


@pytest.fixture(scope="module")
def chat_folder(tmp_path_factory):
    """A tiny Qwen 2 folder (256 positions: room for a conversation) with its tokenizer and a ChatML template."""
    folder = save_hf_folder(tmp_path_factory.mktemp("qwen2"), "qwen2", max_position_embeddings=256)
    (folder / "chat_template.jinja").write_text(CHATML)
    return folder


def test_sampling_follows_generation_config_then_flags(chat_folder, tmp_path):
    folder = tmp_path / "model"
    shutil.copytree(chat_folder, folder)
    (folder / "generation_config.json").write_text(json.dumps(
        {"do_sample": True, "temperature": 0.7, "top_p": 0.8, "eos_token_id": [3, 9]}))
    parser = build_parser("generate")

    def sampling(*flags):
        return read_sampling(folder, parser.parse_args(["--model", "m", "--prompt", "p", *flags]), 0)

    assert sampling() == Sampling(do_sample=True, temperature=0.7, top_k=50, top_p=0.8, eos_ids=frozenset({3, 9}))
    assert sampling("--greedy", "--max-new-tokens", "5") == Sampling(do_sample=False, temperature=0.7, top_p=0.8,
                                                                     max_new_tokens=5, eos_ids=frozenset({3, 9}))
    (folder / "generation_config.json").unlink()  # transformers' defaults: greedy; config.json's eos id
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "eos_token_id": 11}))
    assert sampling() == Sampling(eos_ids=frozenset({11}))
    assert sampling("--top-k", "3") == Sampling(do_sample=True, top_k=3, eos_ids=frozenset({11}))
    (folder / "config.json").write_text(json.dumps({**config, "eos_token_id": None}))
    assert sampling().eos_ids == {0}  # none in either file: the tokenizer's end of text
    (folder / "generation_config.json").write_text(json.dumps({"do_sample": False, "temperature": 0.0}))
    assert not sampling().do_sample  # (a setting greedy decoding does not read is not checked)
    (folder / "generation_config.json").write_text(json.dumps({"do_sample": True, "temperature": 0.0}))
    with pytest.raises(GenerateError, match=r"generation_config.json: temperature=0.0: must be > 0"):
        sampling()
    assert not sampling("--greedy").do_sample


def test_sampling_is_seeded_and_cut_to_top_k_and_top_p(chat_folder):
    model = find_model(str(chat_folder)).load(torch.device("cpu"), torch.float32)

    def draw(seed, **kwargs):
        with Session(model) as session:
            return list(generate_tokens(session, PROMPT, Sampling(do_sample=True, max_new_tokens=8, **kwargs),
                                        torch.Generator().manual_seed(seed)))

    drawn = draw(1)
    assert draw(1) == drawn != draw(2)
    assert draw(1, top_k=1) == draw(2, top_p=1e-6) == greedy(model, PROMPT, 8) != drawn


def _run(args, monkeypatch, capsys, stdin=""):
    monkeypatch.setattr("sys.stdin", io.StringIO(stdin))
    code = cli.main(args)
    out, err = capsys.readouterr()
    return code, out, err


def test_chat_renders_the_conversation_and_stops_at_end_of_turn(chat_folder, tmp_path, monkeypatch, capsys):
    """Each reply is the greedy continuation of the whole conversation so far rendered with the
    template's generation prompt, cut before the first end-of-turn id of generation_config.json;
    the folder is found as a run's export (runs/<name>/<time>/export_hf)."""
    export = tmp_path / "runs" / "sft" / "20260101-000000-000000" / "export_hf"
    shutil.copytree(chat_folder, export)
    found = find_model(str(tmp_path / "runs" / "sft"))
    assert found.weights == export
    model, render, tokenizer = found.load(torch.device("cpu"), torch.float32), chat_template(found), found.tokenizer
    first = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
    assert render(first).endswith("<|im_end|>\n<|im_start|>assistant\n")
    tokens = greedy(model, tokenizer.encode(render(first)), 16)
    stop = next(i for i in range(3, 16) if tokens[i] not in tokens[:i])  # an id that ends the first turn
    (export / "generation_config.json").write_text(json.dumps({"eos_token_id": [tokens[stop]]}))
    reply = tokenizer.decode(tokens[:stop])
    second = first + [{"role": "assistant", "content": reply}, {"role": "user", "content": "And then?"}]
    then = greedy(model, tokenizer.encode(render(second)), 16, eos=[tokens[stop]])
    then = then[:-1] if then[-1] == tokens[stop] else then

    code, out, err = _run(["chat", "--model", str(export.parent), "--system", "Be brief.", "--max-new-tokens", "16"],
                          monkeypatch, capsys, stdin="Hi there\n\nAnd then?\n/exit\nnever read\n")
    assert (code, err) == (0, "")
    assert out == reply + "\n" + tokenizer.decode(then) + "\n"


def test_generate_prints_the_continuation(chat_folder, monkeypatch, capsys):
    model = find_model(str(chat_folder)).load(torch.device("cpu"), torch.float32)
    tokenizer = find_model(str(chat_folder)).tokenizer
    tokens = greedy(model, prompt_ids(tokenizer, "Once upon"), 8, eos=[tokenizer.eot_id])
    expected = tokenizer.decode([t for t in tokens if t != tokenizer.eot_id])
    code, out, err = _run(["generate", "--model", str(chat_folder), "--prompt", "Once upon", "--greedy",
                           "--max-new-tokens", "8"], monkeypatch, capsys)
    assert (code, out) == (0, expected + "\n")
    assert "tokens/s" in err


def test_a_checkpoint_generates_with_its_runs_job(tmp_path, monkeypatch, capsys):
    """A checkpoint folder (DCP: ``state_dict.model.*``) with the run's --recipe and --job options
    gives our decoder of that job with the checkpoint's weights; without them, one line."""
    import torch.distributed.checkpoint as dcp

    from recipes.llama3 import debugmodel
    from titan_lightning.data.tokenizer import load_tokenizer
    from titan_lightning.models.common.decoder import decoder_class

    run = ["--recipe", "recipes.llama3:debugmodel", "--job.model.dim", "64", "--job.model.n_layers", "2",
           "--job.model.n_heads", "4", "--job.model.n_kv_heads", "2"]
    job = debugmodel().job
    job.model = dataclasses.replace(job.model, dim=64, n_layers=2, n_heads=4, n_kv_heads=2)
    model = decoder_class(type(job.model))(job.model)
    model.init_weights(seed=3)
    model.head_in_loss = True
    with warnings.catch_warnings():  # (no process group: DCP says it saves from one process)
        warnings.simplefilter("ignore")
        dcp.save({"state_dict": {f"model.{k}": v for k, v in model.state_dict().items()}}, checkpoint_id=str(tmp_path))
    tokenizer = load_tokenizer(job.data.tokenizer_path)
    tokens = greedy(model.eval(), prompt_ids(tokenizer, "x"), 6, eos=[tokenizer.eot_id])
    expected = tokenizer.decode([t for t in tokens if t != tokenizer.eot_id])

    code, out, err = _run(["generate", "--model", str(tmp_path), "--prompt", "x", "--greedy", "--max-new-tokens", "6",
                           *run], monkeypatch, capsys)
    assert (code, out) == (0, expected + "\n")
    code, out, err = _run(["generate", "--model", str(tmp_path), "--prompt", "x"], monkeypatch, capsys)
    assert code == 2 and "is a checkpoint" in err and "--recipe" in err and len(err.splitlines()) == 1


@pytest.mark.parametrize("args, says", [
    (["generate", "--model", "/no/such/folder", "--prompt", "x"], "no such folder"),
    (["generate", "--model", "{folder}", "--prompt", "x", "--top-p", "1.5"], "--top-p=1.5: must be in (0, 1]"),
    (["generate", "--model", "{folder}", "--prompt", "x", "--temperature", "0"], "--temperature=0.0: must be > 0"),
    (["generate", "--model", "{folder}", "--prompt", "x", "--max-new-tokens", "0"], "--max-new-tokens=0"),
    (["generate", "--model", "{folder}"], "--prompt"),
    (["generate", "--model", "{folder}", "--prompt", "x", "--bogus"], "unknown option '--bogus'"),
    (["chat", "--model", "{bare}"], "has no chat template"),
])
def test_bad_input_is_one_line(chat_folder, tmp_path, monkeypatch, capsys, args, says):
    bare = tmp_path / "bare"
    shutil.copytree(chat_folder, bare, ignore=shutil.ignore_patterns("chat_template.jinja"))
    args = [a.format(folder=chat_folder, bare=bare) for a in args]
    code, out, err = _run(args, monkeypatch, capsys)
    assert (code, out) == (2, "")
    assert says in err and len(err.splitlines()) == 1, err
