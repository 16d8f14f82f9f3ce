"""Every bad input fails before launch: one line on stderr naming the thing, exit status 2, no
traceback, nothing written, Lightning's banner never first (the contract of titan-lightning's
`fit`/`estimate`; loss_compare and run_tests hold it in their own tests).

Each case runs ``cli.main`` in this process (fd-level capture, so Lightning's own log handler is
seen too) in an empty folder; the files a case needs are made by ``_files`` first.
"""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from lightning_utilities.core.rank_zero import rank_zero_only

from titan_lightning import cli
from titan_lightning.data.shards import tokenizer_identity
from titan_lightning.data.tokenizer import load_tokenizer, tokenizer_file
from titan_lightning.trainer import RUN_DIR_ENV

from tests.unit_tests.cpu.checkpoint_folders import SMALL_MODEL, damaged_copies

RECIPES = '''
from recipes.llama3 import debugmodel


def not_a_run():
    return {"module": None}


def raises():
    raise RuntimeError("boom: the recipe could not be built")


def good():
    return debugmodel()
'''

D = ["fit", "--recipe", "recipes.llama3:debugmodel"]
MOE = ["fit", "--recipe", "recipes.qwen3:debugmodel_moe"]
F8 = [*D, "--trainer.accelerator", "cpu", "--job.quantize.float8.enable", "true",
      "--job.quantize.float8.emulate", "true"]


def _files(root: Path) -> None:
    """What the cases point at: bad recipes, configs, corpora, tokenizers, checkpoint folders."""
    from tokenizers import Tokenizer, models

    (root / "my_recipes.py").write_text(RECIPES)
    (root / "broken_import.py").write_text("import not_installed_dependency_xyz\n")
    (root / "broken_syntax.py").write_text("def recipe(:\n    pass\n")
    good = subprocess_free_print_config()
    (root / "good.yaml").write_text(good)
    (root / "bad_yaml.yaml").write_text("recipe: recipes.llama3:debugmodel\njob: {training: [1,\n")
    (root / "bad_type.yaml").write_text(good.replace("    seed: 0\n", "    seed: abc\n"))
    (root / "bad_key.yaml").write_text(good.replace("    seed: 0\n", "    sed: 0\n"))
    (root / "no_recipe.yaml").write_text("trainer:\n  max_steps: 3\n")
    for name, body in (("job_scalar", "job: 5"), ("job_null", "job: null"), ("trainer_scalar", "trainer: 5"),
                       ("training_list", "job: {training: [1, 2]}"), ("training_scalar", "job:\n  training: 5"),
                       ("top_level_section", "training: 5")):
        (root / f"{name}.yaml").write_text(f"recipe: recipes.llama3:debugmodel\n{body}\n")
    (root / "binary.yaml").write_bytes(bytes(range(128, 256)))
    (root / "empty.txt").write_text("")
    (root / "binary.bin").write_bytes(b"\x00\x01\x02\xff\xfe" * 100)
    (root / "nul.txt").write_text("some text\x00more text <|endoftext|> a second document")
    (root / "one_doc.txt").write_text("a single document without any separator\n")
    (root / "short.txt").write_text("tiny <|endoftext|> corpus <|endoftext|> here")
    (root / "not_a_tokenizer.json").write_text("vocab: not json\n")
    Tokenizer(models.BPE()).save(str(root / "no_eot_tokenizer.json"))
    (root / "folder").mkdir()
    (root / "partial_ckpt").mkdir()
    (root / "partial_ckpt" / "meta.pt").write_bytes(b"")
    (root / "a_file.txt").write_text("x")
    (root / "bad.csv").write_text("0F0,0X1\n1F0,1F1\n")
    (root / "rows.csv").write_text("0F0,0B0\n")
    (root / "nofield.jsonl").write_text('{"content": "a document"}\n')
    (root / "chat.jsonl").write_text('{"messages": [{"role": "user", "content": "Hi"}, '
                                     '{"role": "assistant", "content": "Hello"}]}\n')
    (root / "other_shards").mkdir()
    import numpy as np

    np.zeros(3000, dtype="<u2").tofile(root / "other_shards" / "part-00000-00000.tokens")
    np.asarray([1500, 3000], dtype="<i8").tofile(root / "other_shards" / "part-00000-00000.docs")
    (root / "other_shards" / "index.json").write_text(json.dumps({
        "format": "titan-lightning-tokens", "version": 1, "dtype": "uint16", "total_tokens": 3000, "documents": 2,
        "tokenizer": {"sha256": "0" * 64, "vocab_size": 2048, "eos_id": 0, "bos_id": None},
        "shards": [{"name": "part-00000-00000", "tokens": 3000, "documents": 2}]}))
    _shard_set(root / "uint13_shards", np.zeros(3000, dtype="<u2"), dtype="uint13")
    tokenizer = load_tokenizer()
    identity = tokenizer_identity(tokenizer_file(None), tokenizer.vocab_size, tokenizer.eot_id, None)
    _shard_set(root / "past_vocab_shards", np.arange(3000, dtype="<u2") % 2100, tokenizer=identity)
    (root / "unreadable.txt").write_text("a <|endoftext|> b")
    (root / "unreadable.txt").chmod(0)
    (root / "null.parquet").write_bytes(_parquet({"text": [None] * 4, "id": [1, 2, 3, 4]}))
    (root / "bad_middle.jsonl").write_text("".join(['{"text": "one"}\n'] * 200 + ["{not json\n"] +
                                                   ['{"text": "two"}\n'] * 200))
    (root / "hf_model").mkdir()
    (root / "hf_model" / "model.safetensors").write_bytes(b"")
    llama = {"model_type": "llama", "vocab_size": 2048, "hidden_size": 64, "intermediate_size": 160,
             "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "rms_norm_eps": 1e-5,
             "max_position_embeddings": 2048, "rope_theta": 500000.0}
    for name, config in (("hf_llama", llama), ("hf_gpt2", {**llama, "model_type": "gpt2"}),
                         ("hf_odd", {**llama, "sliding_window": 128}), ("hf_bias", {**llama, "attention_bias": True})):
        (root / name).mkdir()
        (root / name / "model.safetensors").write_bytes(b"")
        (root / name / "config.json").write_text(json.dumps(config))
    damaged_copies(root)  # ckpt_small and its damaged copies (tests/unit_tests/cpu/checkpoint_folders.py)
    _hf_weights(root / "hf_shapes", llama, {**llama, "intermediate_size": 192})  # config.json edited after saving
    _hf_weights(root / "hf_truncated", llama, llama)
    _hf_weights(root / "hf_no_tokenizer", llama, llama)
    longrope = {**llama, "model_type": "phi3", "intermediate_size": 96, "original_max_position_embeddings": 64,
                "rope_theta": 10000.0, "rope_scaling": {"type": "longrope", "short_factor": [1.0] * 8,
                                                        "long_factor": [2.0] * 8}}
    _hf_weights(root / "hf_longrope", longrope, longrope)
    (root / "hf_phi3_yarn").mkdir()  # transformers 5's rope_parameters and a legacy yarn rope_scaling
    (root / "hf_phi3_yarn" / "model.safetensors").write_bytes(b"")
    (root / "hf_phi3_yarn" / "config.json").write_text(json.dumps({
        **{k: v for k, v in longrope.items() if k not in ("rope_theta", "rope_scaling")},
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
        "rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}}))
    weights = root / "hf_truncated" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100])
    _sft_and_chat_files(root)


def _sft_and_chat_files(root: Path) -> None:
    """An SFT set whose masks supervise nothing, a set whose tokens file was edited after prepare
    (an id over the vocabulary its index does not record), chat templates: a plain one, one that loops."""
    import numpy as np

    from titan_lightning.testing.sft_shards import write_sft_shards

    ids, zeros = (np.arange(3000) % 2000 + 1).astype(np.int64), np.zeros(1500, np.uint8)
    write_sft_shards(root / "unsupervised_sft_shards", [(ids[:1500], zeros), (ids[1500:], zeros)])
    write_sft_shards(root / "edited_shards", [(ids[:1500], zeros), (ids[1500:], zeros)], loss_mask=False)
    tokens = np.fromfile(root / "edited_shards" / "part-00000-00000.tokens", "<u2")
    tokens[2000] = 5000
    tokens.tofile(root / "edited_shards" / "part-00000-00000.tokens")
    (root / "plain.jinja").write_text("{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}")
    (root / "loop.jinja").write_text("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}"
                                     "{% endfor %}")


def _hf_weights(folder: Path, saved: dict, config: dict) -> None:
    """A Hugging Face folder holding the weights of the model ``saved`` describes, and ``config``."""
    from titan_lightning.models.common.hf_checkpoint import save_hf_safetensors
    from titan_lightning.pretrained import read_hf_model

    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(saved))
    model = read_hf_model(folder)
    module = model.module_class(model.job_class(model=model.args))
    save_hf_safetensors(module.state_dict_adapter().to_hf(module.build_model().state_dict()), folder)
    (folder / "config.json").write_text(json.dumps(config))


def _shard_set(folder: Path, tokens, dtype: str = "uint16", tokenizer=None) -> None:
    """A shard set of one shard holding ``tokens`` as two documents, its index written by hand
    (as a set of another tool, or of a prepare before the index recorded max_id, looks)."""
    import numpy as np

    folder.mkdir()
    np.asarray(tokens, dtype="<u2").tofile(folder / "part-00000-00000.tokens")
    np.asarray([len(tokens) // 2, len(tokens)], dtype="<i8").tofile(folder / "part-00000-00000.docs")
    tokenizer = tokenizer or {"sha256": "0" * 64, "vocab_size": 2048, "eos_id": 0, "bos_id": None}
    (folder / "index.json").write_text(json.dumps({
        "format": "titan-lightning-tokens", "version": 1, "dtype": dtype, "total_tokens": len(tokens),
        "documents": 2, "tokenizer": tokenizer,
        "shards": [{"name": "part-00000-00000", "tokens": len(tokens), "documents": 2}]}))


def _parquet(columns: dict) -> bytes:
    import io

    import pyarrow as pa
    import pyarrow.parquet as pq

    out = io.BytesIO()
    pq.write_table(pa.table({k: pa.array(v, type=pa.string() if k == "text" else None) for k, v in columns.items()}),
                   out)
    return out.getvalue()


_PRINTED: list[str] = []


def subprocess_free_print_config() -> str:
    """The debugmodel's resolved config as --print_config writes it (computed once)."""
    if not _PRINTED:
        import contextlib
        import io

        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            assert cli.main([*D, "--print_config"]) == 0
        _PRINTED.append(out.getvalue())
    return _PRINTED[0]


CASES = [
    # -- the recipe ------------------------------------------------------------------------------
    ("no recipe", ["fit"], "--recipe is required"),
    ("unknown command", ["train", "--recipe", "my_recipes:good"], "unknown command 'train'"),
    ("recipe module missing", ["fit", "--recipe", "no_such_module:x"], "no module named 'no_such_module'"),
    ("recipe function missing", ["fit", "--recipe", "my_recipes:nope"], "has no recipe function 'nope'; it defines: good"),
    ("recipe spec malformed", ["fit", "--recipe", "my_recipes"], "must look like package.module:function"),
    ("recipe returns no Run", ["fit", "--recipe", "my_recipes:not_a_run"], "returned dict, expected titan_lightning.recipe.Run"),
    ("recipe raises", ["fit", "--recipe", "my_recipes:raises"],
     "--recipe='my_recipes:raises' raised RuntimeError: boom: the recipe could not be built"),
    ("recipe import fails", ["fit", "--recipe", "broken_import:x"],
     "importing 'broken_import' failed: ModuleNotFoundError: No module named 'not_installed_dependency_xyz'"),
    ("recipe syntax error", ["fit", "--recipe", "broken_syntax:recipe"], "importing 'broken_syntax' failed: SyntaxError"),
    # -- Hugging Face folders --------------------------------------------------------------------
    ("hf recipe without a folder", ["fit", "--recipe", "recipes.hf:pretrained"],
     "--recipe='recipes.hf:pretrained' needs --job.checkpoint.initial_load_path"),
    ("hf folder missing", ["fit", "--recipe", "recipes.hf:pretrained", "--job.checkpoint.initial_load_path", "nope"],
     "nope/config.json: no config.json"),
    ("hf model_type unsupported", ["fit", "--recipe", "recipes.hf:pretrained", "--job.checkpoint.initial_load_path",
                                   "hf_gpt2"], 'model_type="gpt2" is not supported; supported: llama, qwen3'),
    ("hf config field not modelled", ["fit", "--recipe", "recipes.hf:pretrained",
                                      "--job.checkpoint.initial_load_path", "hf_odd"],
     "hf_odd/config.json: sliding_window=128 not modelled by Llama here"),
    ("hf config value not supported", ["fit", "--recipe", "recipes.hf:pretrained",
                                       "--job.checkpoint.initial_load_path", "hf_bias"],
     "hf_bias/config.json: attention_bias=true is not supported by Llama here (supported: false)"),
    ("hf weights of other shapes", ["fit", "--recipe", "recipes.hf:pretrained", "--job.checkpoint.initial_load_path",
                                    "hf_shapes"],
     "checkpoint.initial_load_path='hf_shapes': loading hf_shapes into Transformer: "
     "model.layers.0.mlp.gate_proj.weight (ours layers.0.feed_forward.w1.weight) has shape (160, 64), the model has "
     "(192, 64)"),
    ("hf weights truncated", ["fit", "--recipe", "recipes.hf:pretrained", "--job.checkpoint.initial_load_path",
                              "hf_truncated"],
     "checkpoint.initial_load_path='hf_truncated': hf_truncated/model.safetensors: not a readable safetensors file "
     "(truncated or corrupt?): the tensors end at byte "),
    ("hf folder without a tokenizer", ["fit", "--recipe", "recipes.hf:pretrained", "--job.checkpoint.initial_load_path",
                                       "hf_no_tokenizer"],
     "checkpoint.initial_load_path='hf_no_tokenizer' has no tokenizer.json, and data.tokenizer_path is not set: the run "
     "would use the shipped 2048-token test tokenizer"),
    ("preset against a folder", [*D, "--job.checkpoint.initial_load_path", "hf_llama",
                                 "--job.checkpoint.initial_load_format", "hf"],
     "model args differ from hf_llama/config.json: hidden_size is 256 here, 64 there"),
    ("gpt-oss sinks on ring attention", ["fit", "--recipe", "recipes.gpt_oss:debugmodel", "--trainer.accelerator", "cpu",
                                        "--trainer.devices", "2", "--job.parallelism.dp_shard", "1",
                                        "--job.parallelism.cp", "2", "--job.model.attention", "ring"],
     "model.attention='ring': gpt-oss's attention sinks are computed by sdpa, flex and (context parallel) allgather "
     "only"),
    ("gpt-oss experts' biases tensor-parallel", ["fit", "--recipe", "recipes.gpt_oss:debugmodel", "--trainer.accelerator",
                                                "cpu", "--trainer.devices", "2", "--job.parallelism.dp_shard", "1",
                                                "--job.parallelism.tp", "2"],
     "parallelism.tp=2 with parallelism.ep=1 makes the experts tensor-parallel, which gpt-oss's expert biases are not "
     "here; set parallelism.ep to a multiple of tp"),
    ("phi3 LongRoPE factor set against seq_len", ["fit", "--recipe", "recipes.hf:pretrained",
                                                  "--job.checkpoint.initial_load_path", "hf_longrope"],
     "model.rope_scaling.factors='short' with training.seq_len=2048: transformers turns sequences of 2048 tokens "
     "with the long factors (long past original_max_position_embeddings=64); set model.rope_scaling.factors='long'"),
    ("hf export of a routing bias", [*MOE, "--job.checkpoint.export_format", "hf"],
     "checkpoint.export_format=hf: Hugging Face Qwen3-MoE has no routing bias"),
    # -- data: prepare, shards, mixtures -----------------------------------------------------------
    ("prepare input missing", ["prepare", "--input", "nope.jsonl", "--output", "out"],
     "--input 'nope.jsonl': no such file or folder"),
    ("prepare empty input", ["prepare", "--input", "empty.txt", "--output", "out"], "empty.txt: empty file"),
    ("prepare binary input", ["prepare", "--input", "nul.txt", "--output", "out"], "nul.txt: binary (a NUL byte at 9)"),
    ("prepare unknown extension", ["prepare", "--input", "bad.csv", "--output", "out"],
     "--input 'bad.csv': .csv extension; prepare reads .jsonl, .json, .txt, .parquet files"),
    ("prepare jsonl without the field", ["prepare", "--input", "nofield.jsonl", "--output", "out"],
     "nofield.jsonl:1: no text field 'text' (--text-field); the record has: content"),
    ("prepare without output", ["prepare", "--input", "one_doc.txt"],
     "prepare: the following arguments are required: --output"),
    ("prepare all-null Parquet column", ["prepare", "--input", "null.parquet", "--output", "out"],
     "null.parquet: the column 'text' is null or empty in all 4 rows; name the column that holds the text with "
     "--text-field (columns: text, id)"),
    ("prepare stops on a bad record", ["prepare", "--input", "bad_middle.jsonl", "--output", "out", "--bad-records",
                                       "stop"], "bad_middle.jsonl:201: not a JSON line (--bad-records stop)"),
    ("prepare output is a file", ["prepare", "--input", "one_doc.txt", "--output", "a_file.txt"],
     "--output 'a_file.txt' is a file; give a folder for the shards"),
    ("prepare --chat without a chat template", ["prepare", "--chat", "--input", "chat.jsonl", "--output", "out"],
     "--chat: the shipped tokenizer has no chat template (no chat_template.jinja, no chat_template in "
     "tokenizer_config.json); give one with --chat-template FILE, or read prompt/response pairs with "
     "--prompt-field and --response-field"),
    ("prepare --max-tokens without chat data", ["prepare", "--input", "one_doc.txt", "--output", "out",
                                                "--max-tokens", "512"],
     "--max-tokens applies to chat and instruction data; add --chat (messages) or --prompt-field and "
     "--response-field (pairs)"),
    ("shards of another tokenizer", [*D, "--job.data.dataset_path", "other_shards"],
     "the shards in other_shards were written by another tokenizer"),
    ("shards of an unknown dtype", [*D, "--job.data.dataset_path", "uint13_shards"],
     "data.dataset_path='uint13_shards': index.json has dtype=\"uint13\"; token shards are uint16 or uint32"),
    ("shards past the vocabulary", [*D, "--job.data.dataset_path", "past_vocab_shards"],
     "data.dataset_path='past_vocab_shards' holds token id 2099 (a scan found it), out of range for "
     "model.vocab_size=2048"),
    ("mixture weight not positive", [*D, "--job.data.sources", '[{"path": "other_shards", "weight": 0}]'],
     "data.sources[0].weight=0.0 (other_shards) must be > 0"),
    ("mixture source missing", [*D, "--job.data.sources", '[{"path": "nope_dir"}]'],
     "data.sources[0].path='nope_dir': no such file or folder"),
    # -- options -----------------------------------------------------------------------------------
    ("unknown job key", [*D, "--job.training.sed", "3"], "unknown option --job.training.sed; valid keys under job.training: seed"),
    ("unknown trainer key", [*D, "--trainer.max_stepz", "3"], "unknown option --trainer.max_stepz"),
    ("unknown option", [*D, "--foo", "1"], "unknown option --foo; valid options: --recipe"),
    ("ill-typed value", [*D, "--job.training.seed", "abc"], "job.training.seed: Expected a <class 'int'>. Got value: abc"),
    ("negative lr", [*D, "--job.optimizer.lr", "-1"], "optimizer.lr=-1.0 must be > 0"),
    ("lr not a number", [*D, "--job.optimizer.lr", "nan"],
     "job.optimizer.lr: Expected a <class 'float'>. Got value: nan; give a finite number (the recipe's: 0.002)"),
    ("compile backend unknown", [*D, "--job.compile.backend", "nosuchbackend"],
     "compile.backend='nosuchbackend' is not a torch.compile backend; valid: aot_eager, "),
    ("max_steps 0", [*D, "--trainer.max_steps", "0"], "trainer.max_steps=0 must be >= 1"),
    ("precision unsupported", [*D, "--trainer.precision", "16-mixed"], "trainer.precision='16-mixed' is not supported"),
    ("trainer arg owned by the job", [*D, "--trainer.gradient_clip_val", "1.0"],
     "trainer.gradient_clip_val=1.0 is set by job.training.max_grad_norm"),
    ("seq_len over max_seq_len", [*D, "--job.training.seq_len", "1048576",
                                  "--job.training.tokens_per_microbatch_per_dp_rank", "1048576"],
     "training.seq_len=1048576 must be <= model.max_seq_len"),
    ("microbatch not whole sequences", [*D, "--job.training.seq_len", "1000"],
     "training.tokens_per_microbatch_per_dp_rank=2048 must be a multiple of training.seq_len=1000"),
    ("loss_chunks not positive", [*D, "--job.training.loss_chunks", "0"],
     "training.loss_chunks=0 must be a positive integer (chunks of the tokens), or None for the plain loss"),
    ("tokens_per_step not a multiple", [*D, "--job.training.tokens_per_step", "1000"],
     "training.tokens_per_step=1000 must be a multiple of"),
    # -- the config file -------------------------------------------------------------------------
    ("config missing", ["fit", "--config", "nope.yaml"], "--config='nope.yaml': No such file or directory"),
    ("config is a folder", ["fit", "--config", "folder"], "--config='folder': Is a directory"),
    ("config without value", ["fit", "--config"], "--config needs a file"),
    ("config not YAML", ["fit", "--config", "bad_yaml.yaml"], "--config='bad_yaml.yaml', line 3: not valid YAML"),
    ("config not text", ["fit", "--config", "binary.yaml"], "--config='binary.yaml' is not UTF-8 text"),
    ("config ill-typed", ["fit", "--config", "bad_type.yaml"],
     "--config='bad_type.yaml', line 28: job.training.seed: Expected a <class 'int'>. Got value: abc"),
    ("config unknown key", ["fit", "--config", "bad_key.yaml"],
     "--config='bad_key.yaml', line 28: unknown key job.training.sed; valid keys under job.training: seed"),
    ("config without recipe", ["fit", "--config", "no_recipe.yaml"], "names no recipe"),
    ("config job a scalar", ["fit", "--config", "job_scalar.yaml"],
     "--config='job_scalar.yaml', line 2: job=5 must be a mapping of model, training, parallelism"),
    ("config job null", ["fit", "--config", "job_null.yaml"],
     "--config='job_null.yaml', line 2: job=null must be a mapping of model, training"),
    ("config trainer a scalar", ["fit", "--config", "trainer_scalar.yaml"],
     "--config='trainer_scalar.yaml', line 2: trainer=5 must be a mapping of lightning.Trainer arguments"),
    ("config section a list", ["fit", "--config", "training_list.yaml"],
     "--config='training_list.yaml', line 2: job.training=[1, 2] must be a mapping of seed, seq_len"),
    ("config section a scalar", ["fit", "--config", "training_scalar.yaml"],
     "--config='training_scalar.yaml', line 3: job.training=5 must be a mapping of seed, seq_len"),
    ("config section at the top", ["fit", "--config", "top_level_section.yaml"],
     "--config='top_level_section.yaml', line 2: unknown key training; valid keys: recipe, job, trainer"),
    # -- layouts ---------------------------------------------------------------------------------
    ("tp over the world", [*D, "--job.parallelism.tp", "2"], "world size 1 is not divisible by dp_replicate*tp*pp*cp"),
    ("dp_shard vs devices", [*D, "--job.parallelism.dp_shard", "2"], "= 2 must equal the world size 1"),
    ("tp vs heads", [*D, "--trainer.devices", "3", "--job.parallelism.tp", "3"],
     "model.n_heads=16 must be divisible by parallelism.tp=3"),
    ("pp vs layers", [*D, "--trainer.devices", "8", "--job.parallelism.pp", "8", "--job.parallelism.pp_schedule",
                      "GPipe", "--job.parallelism.dp_shard", "1"], "8 stages is more than model.n_layers=6"),
    ("cp without a CP attention", [*D, "--trainer.devices", "2", "--job.parallelism.cp", "2"],
     "parallelism.cp=2 needs a context-parallel attention"),
    ("cp vs seq_len", [*D, "--trainer.devices", "4", "--job.parallelism.cp", "4", "--job.model.attention", "allgather",
                       "--job.training.seq_len", "20", "--job.training.tokens_per_microbatch_per_dp_rank", "80"],
     "training.seq_len=20 must be divisible by 8"),
    ("ep on a dense model", [*D, "--trainer.devices", "2", "--job.parallelism.ep", "2"],
     "parallelism.ep=2 needs a mixture-of-experts model"),
    ("ep vs experts", [*MOE, "--trainer.devices", "3", "--job.parallelism.ep", "3"],
     "parallelism.ep=3 must divide model.moe.num_experts"),
    ("window on latent attention", ["fit", "--recipe", "recipes.deepseek_v3:debugmodel", "--job.model.sliding_window", "16"],
     "model.sliding_window=16: DeepSeekV3Args's attention has no sliding window"),
    ("ep dispatch unknown", [*MOE, "--job.parallelism.ep_dispatch", "sync_free"],
     "parallelism.ep_dispatch='sync_free' is not one of splits, padded"),
    ("token group alignment", [*MOE, "--job.model.moe.token_group_align", "0"],
     "moe.token_group_align=0 must be a positive integer (e.g. 8, 16, 128), or None"),
    ("DDP with pp", [*D, "--trainer.devices", "4", "--job.parallelism.dp_replicate", "2", "--job.parallelism.dp_shard",
                     "1", "--job.parallelism.pp", "2", "--job.parallelism.pp_microbatches", "2"],
     "parallelism.pp=2 with dp_replicate=2 and no FSDP"),
    ("DDP with ep", [*MOE, "--trainer.devices", "4", "--job.parallelism.dp_replicate", "2", "--job.parallelism.dp_shard",
                     "1", "--job.parallelism.tp", "2", "--job.parallelism.ep", "2"],
     "parallelism.ep=2 with dp_replicate=2 and no FSDP"),
    ("unknown pp schedule", [*D, "--job.parallelism.pp_schedule", "Zigzag"], "parallelism.pp_schedule='Zigzag' is not one of"),
    ("looped schedule, 1 stage per rank", [*D, "--trainer.devices", "2", "--job.parallelism.pp", "2",
                                          "--job.parallelism.pp_schedule", "Interleaved1F1B",
                                          "--job.parallelism.pp_stages_per_rank", "1"],
     "is a looped schedule and needs several stages per rank"),
    ("unknown CP load balancer", [*D, "--job.parallelism.cp_load_balancer", "zigzag"],
     "parallelism.cp_load_balancer='zigzag' is not one of"),
    ("schedule CSV missing", [*D, "--trainer.devices", "2", "--job.parallelism.pp", "2", "--job.parallelism.pp_microbatches",
                              "2", "--job.parallelism.pp_schedule_csv", "nope.csv"],
     "parallelism.pp_schedule_csv='nope.csv' is not a file"),
    ("schedule CSV with a bad action", [*D, "--trainer.devices", "2", "--job.parallelism.pp", "2",
                                        "--job.parallelism.pp_microbatches", "2", "--job.parallelism.pp_schedule_csv",
                                        "bad.csv"], "row 1, column 2: '0X1' is not an action"),
    ("schedule CSV with too few rows", [*D, "--trainer.devices", "2", "--job.parallelism.pp", "2",
                                        "--job.parallelism.pp_microbatches", "2", "--job.parallelism.pp_schedule_csv",
                                        "rows.csv"], "has 1 rows; it needs one per pipeline rank (parallelism.pp=2)"),
    # -- data and tokenizer ----------------------------------------------------------------------
    ("dataset missing", [*D, "--job.data.dataset_path", "nope.txt"], "data.dataset_path='nope.txt': no such file"),
    ("dataset empty", [*D, "--job.data.dataset_path", "empty.txt"], "data.dataset_path='empty.txt' is empty"),
    ("dataset binary", [*D, "--job.data.dataset_path", "binary.bin"], "data.dataset_path='binary.bin' is not UTF-8 text"),
    ("dataset with NUL bytes", [*D, "--job.data.dataset_path", "nul.txt"], "data.dataset_path='nul.txt' is not text"),
    ("dataset is a folder", [*D, "--job.data.dataset_path", "folder"], "data.dataset_path='folder' is not a file"),
    ("dataset unreadable", [*D, "--job.data.dataset_path", "unreadable.txt"],
     "data.dataset_path='unreadable.txt' cannot be read (Permission denied); give a file this user may read"),
    ("dataset of one document", [*D, "--job.data.dataset_path", "one_doc.txt"], "holds 1 document(s)"),
    ("dataset shorter than a window", [*D, "--job.data.dataset_path", "short.txt"],
     "the train split of data.dataset_path='short.txt'"),
    ("tokenizer missing", [*D, "--job.data.tokenizer_path", "nope.json"], "data.tokenizer_path='nope.json': no such file"),
    ("tokenizer not a tokenizer", [*D, "--job.data.tokenizer_path", "not_a_tokenizer.json"],
     "data.tokenizer_path='not_a_tokenizer.json' is not a `tokenizers` JSON file"),
    ("tokenizer folder without tokenizer.json", [*D, "--job.data.tokenizer_path", "folder"],
     "data.tokenizer_path='folder' is a folder without tokenizer.json"),
    ("tokenizer without end-of-text", [*D, "--job.data.tokenizer_path", "no_eot_tokenizer.json"],
     "data.tokenizer_path='no_eot_tokenizer.json': the tokenizer has no '<|endoftext|>' token"),
    ("tokenizer larger than the model", [*D, "--job.model.vocab_size", "1024"],
     "the data's tokenizer has 2048 tokens, more than model.vocab_size=1024"),
    # -- checkpoints and weights ----------------------------------------------------------------
    ("initial weights missing", [*D, "--job.checkpoint.initial_load_path", "nope"],
     "checkpoint.initial_load_path='nope' does not exist"),
    ("initial weights not a DCP folder", [*D, "--job.checkpoint.initial_load_path", "folder"],
     "checkpoint.initial_load_path='folder' holds no .metadata"),
    ("initial weights HF folder read as DCP", [*D, "--job.checkpoint.initial_load_path", "hf_model"],
     "set checkpoint.initial_load_format=hf"),
    ("initial weights not an HF folder", [*D, "--job.checkpoint.initial_load_path", "folder",
                                          "--job.checkpoint.initial_load_format", "hf"],
     "holds no model.safetensors or model.safetensors.index.json"),
    ("resume from nothing", [*D, "--job.checkpoint.resume_from", "nope"], "checkpoint.resume_from='nope' does not exist"),
    ("resume from an empty folder", [*D, "--job.checkpoint.resume_from", "folder"],
     "checkpoint.resume_from='folder' does not point to a valid checkpoint"),
    ("resume from an unfinished save", [*D, "--job.checkpoint.resume_from", "partial_ckpt"],
     "a save that did not finish leaves such a folder"),
    ("resume from a file", [*D, "--job.checkpoint.resume_from", "a_file.txt"], "is a file; TitanStrategy checkpoints are folders"),
    ("bad checkpoint interval", [*D, "--job.checkpoint.interval", "0"], "checkpoint.interval=0 must be an integer >= 1"),
    # -- float8 (quantize.float8) ------------------------------------------------------------------
    ("float8 unknown recipe", [*D, "--job.quantize.float8.recipe", "mxfp8"],
     "quantize.float8.recipe='mxfp8' is not one of tensorwise, rowwise"),
    ("float8 all-gather with rowwise", [*D, "--job.quantize.float8.recipe", "rowwise",
                                        "--job.quantize.float8.enable_fsdp_float8_all_gather", "true"],
     "quantize.float8.enable_fsdp_float8_all_gather=True needs recipe='tensorwise'"),
    ("float8 on CPU without emulation", [*D, "--trainer.accelerator", "cpu", "--job.quantize.float8.enable", "true"],
     "quantize.float8.enable=True on 'cpu' needs quantize.float8.emulate=True"),
    ("float8 tp with sp on gloo", [*F8, "--trainer.devices", "2", "--job.parallelism.tp", "2",
                                   "--job.parallelism.dp_shard", "1"],
     "quantize.float8.recipe='tensorwise' with parallelism.tp=2 and parallelism.sequence_parallel=True cannot run"),
    ("float8 all-gather on gloo", [*F8, "--job.quantize.float8.enable_fsdp_float8_all_gather", "true"],
     "quantize.float8.enable_fsdp_float8_all_gather=True cannot run on CPU: gloo has no float8 all-gather"),
    # -- estimate ----------------------------------------------------------------------------------
    ("estimate without world size", ["estimate", "--recipe", "recipes.llama3:debugmodel"], "estimate needs --world_size N"),
    ("estimate bad world size", ["estimate", "--world_size", "0", "--recipe", "recipes.llama3:debugmodel"],
     "--world_size=0 must be >= 1"),
    ("estimate bad recipe", ["estimate", "--world_size", "2", "--recipe", "my_recipes:raises"], "raised RuntimeError: boom"),
    ("estimate bad layout", ["estimate", "--world_size", "2", "--recipe", "recipes.llama3:debugmodel",
                             "--job.parallelism.tp", "3"], "world size 2 is not divisible"),
    # -- damaged checkpoints and checkpoints of another model (checkpoint_folders.py) ---------------
    ("checkpoint with a flipped bit in a weight", [*D, *SMALL_MODEL, "--job.checkpoint.resume_from", "ckpt_bitflip"],
     "checkpoint.resume_from='ckpt_bitflip': __0_0.distcp is corrupt (crc32 "),
    ("initial weights with a flipped bit", [*D, *SMALL_MODEL, "--job.checkpoint.initial_load_path", "ckpt_bitflip"],
     "checkpoint.initial_load_path='ckpt_bitflip': __0_0.distcp is corrupt (crc32 "),
    ("checkpoint with flipped bytes in .metadata", [*D, *SMALL_MODEL, "--job.checkpoint.resume_from", "ckpt_bad_metadata"],
     "checkpoint.resume_from='ckpt_bad_metadata': .metadata is corrupt (crc32 "),
    ("checkpoint .metadata unreadable, checksums off", [*D, *SMALL_MODEL, "--job.checkpoint.resume_from",
                                                        "ckpt_bad_metadata", "--job.checkpoint.verify_checksums", "false"],
     "checkpoint.resume_from='ckpt_bad_metadata': cannot read .metadata"),
    ("checkpoint with a truncated shard", [*D, *SMALL_MODEL, "--job.checkpoint.resume_from", "ckpt_truncated"],
     "checkpoint.resume_from='ckpt_truncated': __0_0.distcp is truncated ("),
    ("checkpoint with a deleted shard", [*D, *SMALL_MODEL, "--job.checkpoint.resume_from", "ckpt_no_shard"],
     "checkpoint.resume_from='ckpt_no_shard': __0_0.distcp is missing"),
    ("checkpoint without checksums, truncated shard", [*D, *SMALL_MODEL, "--job.checkpoint.resume_from",
                                                       "ckpt_old_truncated"],
     "checkpoint.resume_from='ckpt_old_truncated': shard file __0_0.distcp is truncated"),
    ("resume a checkpoint of another model size", [*D, "--job.checkpoint.resume_from", "ckpt_small"],
     "checkpoint.resume_from='ckpt_small': model.tok_embeddings.weight is (2048, 64) there, (2048, 256) in this run's model"),
    ("resume a checkpoint of another family", ["fit", "--recipe", "recipes.qwen3:debugmodel", *SMALL_MODEL,
                                              "--job.model.head_dim", "16", "--job.checkpoint.resume_from", "ckpt_small"],
     "checkpoint.resume_from='ckpt_small' holds no model.layers.0.attention.q_norm.weight, which this run's model has"),
    ("initial weights of another model size", [*D, "--job.checkpoint.initial_load_path", "ckpt_small"],
     "checkpoint.initial_load_path='ckpt_small': model.tok_embeddings.weight is (2048, 64) there, (2048, 256)"),
    ("verify_checksums not a bool", [*D, "--job.checkpoint.verify_checksums", "maybe"], "verify_checksums"),
    ("SFT shards supervising no token", [*D, "--job.data.dataset_path", "unsupervised_sft_shards", "--job.data.sft",
                                         "true", "--job.data.sft_packing", "padded"],
     "data.dataset_path='unsupervised_sft_shards': its loss masks supervise none of its 3000 tokens (prepared with "
     "--train-on assistant); prepare it again with the chat template that renders the assistant's turns, or "
     "--train-on all"),
    ("token shard edited after prepare", [*D, "--job.data.dataset_path", "edited_shards"],
     "edited_shards/part-00000-00000.tokens holds token id 5000 (its token 2000), above the largest id its "
     "index.json records (2000): the file changed after prepare; prepare the shard set again"),
    ("prepare chat template that loops", ["prepare", "--chat", "--input", "chat.jsonl", "--chat-template", "loop.jinja",
                                          "--output", "out"],
     "chat.jsonl:1: the chat template (--chat-template loop.jinja) stops: it renders for over 2 s"),
    ("prepare --too-long truncate leaving nothing supervised", [
        "prepare", "--chat", "--input", "chat.jsonl", "--chat-template", "plain.jinja", "--max-tokens", "2",
        "--too-long", "truncate", "--output", "out"],
     "chat.jsonl: all its 1 conversations that are not bad records have no supervised token in their first "
     "--max-tokens 2 (--too-long truncate drops a conversation left with nothing to train on); raise --max-tokens"),
    ("prepare --tools-field no record has", ["prepare", "--chat", "--input", "chat.jsonl", "--chat-template",
                                             "plain.jinja", "--tools-field", "functons", "--output", "out"],
     "--tools-field 'functons': no record has this field; the records have: messages"),
    ("phi3 rope_parameters with a legacy yarn rope_scaling", ["fit", "--recipe", "recipes.hf:pretrained",
                                                              "--job.checkpoint.initial_load_path", "hf_phi3_yarn"],
     'hf_phi3_yarn/config.json: rope_scaling={"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64} '
     'next to rope_parameters={"rope_type": "default", "rope_theta": 10000.0}: transformers reads the legacy '
     'rope_scaling (yarn) and refuses it: Phi3 takes default or longrope RoPE; keep one of the two'),
]


def test_there_are_at_least_45_cases_and_names_are_unique():
    assert len(CASES) >= 45
    assert len({name for name, _, _ in CASES}) == len(CASES)


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    root = tmp_path_factory.mktemp("inputs")
    _files(root)
    return root


# Root reads a file whatever its mode: the unreadable-file case cannot be made as root.
_ROOT_READS_ALL = {"dataset unreadable"} if hasattr(os, "geteuid") and os.geteuid() == 0 else set()


@pytest.mark.parametrize("name, argv, message", [
    pytest.param(*case, marks=pytest.mark.skipif(case[0] in _ROOT_READS_ALL, reason="root reads a file of mode 000"))
    for case in CASES], ids=[c[0].replace(" ", "_") for c in CASES])
def test_bad_input_is_one_line_exit_2_nothing_written(name, argv, message, inputs, capfd, monkeypatch):
    assert_refused(name, argv, message, inputs, capfd, monkeypatch)


def assert_refused(name, argv, message, inputs: Path, capfd, monkeypatch) -> None:
    """``titan-lightning <argv>`` run in ``inputs`` exits 2 with one line on stderr holding ``message``,
    no traceback, nothing written, within 10 s (other modules' bad-input cases call it too)."""
    monkeypatch.chdir(inputs)
    monkeypatch.syspath_prepend(str(inputs))
    monkeypatch.delenv(RUN_DIR_ENV, raising=False)
    before = sorted(p.name for p in inputs.iterdir())
    start = time.monotonic()
    assert cli.main(argv) == 2
    elapsed = time.monotonic() - start
    out, err = capfd.readouterr()
    assert err.count("\n") == 1 and err.startswith("titan-lightning: error: "), err
    assert message in err, err
    assert "Traceback" not in err and out == "", (out, err)
    assert sorted(p.name for p in inputs.iterdir()) == before  # no run folder, nothing else
    assert elapsed < 10, f"{name}: {elapsed:.1f} s"


def test_debug_variable_shows_the_traceback(inputs, capfd, monkeypatch):
    monkeypatch.chdir(inputs)
    monkeypatch.syspath_prepend(str(inputs))
    monkeypatch.setenv("TITAN_LIGHTNING_DEBUG", "1")
    assert cli.main(["fit", "--recipe", "my_recipes:raises"]) == 2
    err = capfd.readouterr().err
    assert "Traceback" in err and err.strip().splitlines()[-1].startswith("titan-lightning: error: ")


def test_config_fifo_without_a_writer_is_refused_not_waited_on(tmp_path, capfd, monkeypatch):
    """A FIFO nobody writes to: one line after CONFIG_PIPE_WAIT_S, instead of blocking in open()."""
    import threading

    monkeypatch.setattr(cli, "CONFIG_PIPE_WAIT_S", 0.3)
    fifo = tmp_path / "run.yaml"
    os.mkfifo(fifo)
    result = []
    thread = threading.Thread(target=lambda: result.append(cli.main(["fit", "--config", str(fifo)])), daemon=True)
    thread.start()
    thread.join(timeout=30)
    if thread.is_alive():  # a regression blocks in open() or read(): a writer releases it, then fail
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        thread.join(timeout=30)
        pytest.fail("--config on a FIFO without a writer blocked")
    err = capfd.readouterr().err
    assert result == [2] and err.count("\n") == 1, err
    assert f"--config={str(fifo)!r}: nothing to read for 0.3 s (a FIFO with no writer?)" in err, err


def test_config_from_a_pipe_with_a_writer_is_read_once(tmp_path, capfd):
    """``--config <(cat run.yaml)``: the shell passes /dev/fd/N, a pipe whose writer may be late."""
    import threading

    text = subprocess_free_print_config()
    read, write = os.pipe()

    def writer():
        time.sleep(0.2)
        os.write(write, text.encode())
        os.close(write)

    thread = threading.Thread(target=writer, daemon=True)
    thread.start()
    try:
        assert cli.main(["fit", "--config", f"/dev/fd/{read}", "--print_config"]) == 0
    finally:
        thread.join(timeout=10)
        os.close(read)
    out, err = capfd.readouterr()
    assert out == text and err == ""


def test_resume_latest_with_nothing_saved_starts_fresh_in_one_line(tmp_path, capfd, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv(RUN_DIR_ENV, str(tmp_path / "runs" / "llama3_debugmodel" / "now"))
    prepared = cli.prepare([*D, "--job.checkpoint.resume_from", "latest"])
    command, run, trainer = prepared
    assert run.ckpt_path is None and run.inputs_checked
    err = capfd.readouterr().err
    assert "checkpoint.resume_from='latest': no complete checkpoint under" in err and "starting from step 0" in err


def test_a_checkpoint_loaded_without_its_crc32_check_is_said_once(inputs, tmp_path, capfd, monkeypatch):
    """checkpoint.verify_checksums=false, or a manifest from before checksums: one warning line at the
    load's check, saying what goes unnoticed; the corrupt-checkpoint error says what turning it off does."""
    import shutil

    from tests.unit_tests.cpu.checkpoint_folders import drop_checksums
    from titan_lightning.checkpoint import CheckpointError, resolve_resume

    monkeypatch.setattr(rank_zero_only, "rank", 0)  # (said on rank 0 only; an earlier test may have left another)
    with pytest.raises(CheckpointError, match=r"verify_checksums=false loads it as it is: the damaged bytes are trained on"):
        resolve_resume(str(inputs / "ckpt_bitflip"), tmp_path)
    assert resolve_resume(str(inputs / "ckpt_small"), tmp_path) is not None
    assert capfd.readouterr().err == ""
    assert resolve_resume(str(inputs / "ckpt_bitflip"), tmp_path, checksums=False) is not None
    err = capfd.readouterr().err
    assert err.count("\n") == 1 and f"checkpoint.resume_from='{inputs / 'ckpt_bitflip'}': loaded without" in err, err
    assert "loaded without a crc32 check (checkpoint.verify_checksums=false)" in err and "unnoticed" in err, err
    old = shutil.copytree(inputs / "ckpt_small", tmp_path / "old")
    drop_checksums(old)
    assert resolve_resume(str(old), tmp_path) is not None
    err = capfd.readouterr().err
    assert err.count("\n") == 1 and "its manifest records no checksums" in err, err


def test_a_diverging_run_ends_in_one_line(tmp_path, capfd, monkeypatch):
    """``--job.optimizer.lr 1e30``: the module's non-finite stop (test_causal_lm.py) is one line and exit 1,
    no traceback (the fit itself stands in here: a real diverging run costs a minute on 2 cores)."""
    def diverge(command, run, trainer):
        raise FloatingPointError("non-finite gradient norm nan at step 2; stopping before step 3's optimizer step")

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv(RUN_DIR_ENV, str(tmp_path / "runs" / "now"))
    monkeypatch.setattr(cli, "execute", diverge)
    assert cli.main([*D, "--job.optimizer.lr", "1e30", "--trainer.enable_progress_bar", "false"]) == 1
    err = capfd.readouterr().err
    assert "Traceback" not in err and err.count("titan-lightning: error:") == 1, err
    assert "non-finite gradient norm nan at step 2; stopping before step 3's optimizer step" in err.splitlines()[-1]



def test_a_run_failure_starts_its_own_line_under_a_progress_bar(tmp_path, capfd, monkeypatch):
    """After launch a progress bar may have left its line unended: the error line starts a new one."""
    def fail(command, run, trainer):
        print("Epoch 0, step 3/10: 30%", end="", file=sys.stderr, flush=True)  # a bar mid-line
        raise FloatingPointError("non-finite training loss nan at step 3")

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv(RUN_DIR_ENV, str(tmp_path / "runs" / "now"))
    monkeypatch.setattr(cli, "execute", fail)
    assert cli.main(D) == 1
    err = capfd.readouterr().err
    lines = err.splitlines()  # (Lightning's "GPU available" lines may come first)
    line = lines[lines.index("Epoch 0, step 3/10: 30%") + 1]
    assert line.startswith("titan-lightning: error: ") and "non-finite training loss nan at step 3" in line, repr(err)

CONSOLE_CASES = [
    (["fit", "--recipe", "recipes.llama3:nope"], "has no recipe function 'nope'"),
    # Needs the Trainer (the world size): Lightning's banner must not come first.
    (["fit", "--recipe", "recipes.llama3:debugmodel", "--trainer.devices", "3", "--job.parallelism.tp", "3"],
     "model.n_heads=16 must be divisible by parallelism.tp=3"),
]


@pytest.fixture(scope="module")
def console_runs(tmp_path_factory):
    """The console-script runs of CONSOLE_CASES, started together (the import is most of their
    time), each in an empty folder of its own; ``console_runs(argv)`` waits for one."""
    env = {k: v for k, v in os.environ.items() if k != RUN_DIR_ENV}
    started = {}
    for argv, _ in CONSOLE_CASES:
        folder = tmp_path_factory.mktemp("console")
        started[tuple(argv)] = folder, subprocess.Popen(
            [sys.executable, "-m", "titan_lightning.cli", *argv], cwd=folder, env=env, text=True,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE)

    def wait(argv):
        folder, process = started[tuple(argv)]
        stdout, stderr = process.communicate(timeout=120)
        return subprocess.CompletedProcess(argv, process.returncode, stdout, stderr), folder

    yield wait
    for _, process in started.values():
        if process.poll() is None:
            process.kill()
            process.communicate()


@pytest.mark.parametrize("argv, message", CONSOLE_CASES)
def test_console_script_prints_the_error_alone(console_runs, argv, message):
    result, folder = console_runs(argv)
    assert result.returncode == 2
    assert result.stdout == "" and result.stderr.count("\n") == 1, (result.stdout, result.stderr)
    assert message in result.stderr
    assert list(folder.iterdir()) == []


def test_banner_is_held_even_when_the_program_logs_through_the_root_logger(inputs, capfd, monkeypatch):
    """A program (or an earlier test) that configured the root logger still sees only the error."""
    import logging

    monkeypatch.chdir(inputs)
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(levelname)s: %(message)s"))
    root, lightning = logging.getLogger(), logging.getLogger("lightning.pytorch")
    monkeypatch.setattr(lightning, "propagate", True)
    root.addHandler(handler)
    try:
        assert cli.main([*D, "--trainer.devices", "3", "--job.parallelism.tp", "3"]) == 2
    finally:
        root.removeHandler(handler)
    err = capfd.readouterr().err
    assert err.count("\n") == 1 and "model.n_heads=16 must be divisible by parallelism.tp=3" in err, err
