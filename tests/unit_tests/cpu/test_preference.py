"""Preference training (#49): ``prepare --preference`` writes each pair's two answers one after the
other with the mask on the answers; PairWindows packs pairs whole; the DPO, IPO and SimPO losses and
their gradients, from our chunked per-token loss over packed windows, equal an independent
computation with the transformers model of the same folder on each sequence alone (fp32, CPU), the
losses as TRL writes them (TRL's DPOTrainer itself on the same batch: test_preference_trl.py);
recipes.hf:dpo logs TRL's metrics, trains on 2 ranks with accumulation as in one process, and its
three reference modes agree."""

import json
import math
import re
import shutil
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from tests.hf_folders import save_hf_folder, save_hf_model
from titan_lightning.config.preference import PreferenceConfig
from titan_lightning.data.prepare import PrepareError, main as prepare_main
from titan_lightning.data.shards import ShardSet
from titan_lightning.data.tokenizer import load_tokenizer
from titan_lightning.models.common.loss import IGNORE_INDEX

POSITIONS = 320  # RoPE positions of the tiny models: a window of packed pairs
TEMPLATE = Path(__file__).resolve().parents[2] / "assets" / "chat_templates" / "chatml_generation.jinja"
# Explicit prompts (text, messages) and the implicit form, answers of very uneven lengths.
RECORDS = [
    {"prompt": "What is two plus two?", "chosen": "Four.", "rejected": "Five, I think, though it may also be six."},
    {"prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}],
     "chosen": [{"role": "assistant", "content": "Blue, the colour of a clear sky in the morning."}],
     "rejected": [{"role": "assistant", "content": "No."}]},
    {"chosen": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello! How can I help?"}],
     "rejected": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Go away."}]},
    {"prompt": "Say yes.", "chosen": "Yes.", "rejected": "Yes."},  # a bad record: the same answers
    {"prompt": "Count to three.", "chosen": "One, two, three.", "rejected": "One, three."},
]


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    """A qwen2 folder with a ChatML template, a reference model (another seed), the pairs prepared."""
    root = tmp_path_factory.mktemp("preference")
    folder = save_hf_folder(root / "policy", "qwen2", max_position_embeddings=POSITIONS)
    shutil.copy(TEMPLATE, folder / "chat_template.jinja")
    save_hf_model(root / "reference", "qwen2", seed=1, max_position_embeddings=POSITIONS)
    (root / "pairs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in RECORDS))
    prepare_main(["--preference", "--input", str(root / "pairs.jsonl"), "--tokenizer", str(folder), "--output",
                  str(root / "shards"), "--workers", "1", "--no-progress"])
    return root


def _documents(shards: ShardSet) -> list[tuple[np.ndarray, np.ndarray]]:
    ends = shards.document_ends().tolist()
    return [(shards.read(a, b), shards.read_mask(a, b)) for a, b in zip([0, *ends[:-1]], ends)]


def test_prepare_writes_each_pair_chosen_then_rejected_with_the_answers_supervised(prepared, capsys):
    shards = ShardSet(prepared / "shards")
    tokenizer = load_tokenizer(str(prepared / "policy"))
    assert shards.index["sft"]["pairs"] == 4  # the record with the same answers is skipped
    docs = _documents(shards)
    assert len(docs) == 8
    good = [r for r in RECORDS if r["chosen"] != r["rejected"]]
    for k, record in enumerate(good):
        for (ids, mask), side in zip(docs[2 * k:2 * k + 2], ("chosen", "rejected")):
            answer = record[side] if isinstance(record[side], str) else record[side][-1]["content"]
            assert tokenizer.decode(ids[mask == 1].tolist()) == answer + "<|im_end|>"
        # The two answers share their prompt, token for token, up to the first supervised token.
        (a, ma), (b, mb) = docs[2 * k:2 * k + 2]
        start = int(np.argmax(ma))
        assert start == int(np.argmax(mb)) and (a[:start] == b[:start]).all()


def test_a_pair_is_dropped_whole_and_bad_pairs_are_named(prepared, tmp_path):
    out = tmp_path / "short"
    prepare_main(["--preference", "--input", str(prepared / "pairs.jsonl"), "--tokenizer", str(prepared / "policy"),
                  "--output", str(out), "--workers", "1", "--no-progress", "--max-tokens", "85"])
    sft = ShardSet(out).index["sft"]
    assert sft["conversations"] == 2 * sft["pairs"] and sft["pairs"] >= 1 and sft["dropped"] >= 1
    with pytest.raises(PrepareError, match=r"pairs.jsonl:4: 'chosen' and 'rejected' are the same \(--bad-records "
                                           r"stop\)"):
        prepare_main(["--preference", "--input", str(prepared / "pairs.jsonl"), "--tokenizer",
                      str(prepared / "policy"), "--output", str(tmp_path / "stop"), "--workers", "1",
                      "--no-progress", "--bad-records", "stop"])
    with pytest.raises(PrepareError, match="--chat does not apply to --preference"):
        prepare_main(["--preference", "--chat", "--input", str(prepared / "pairs.jsonl"), "--output",
                      str(tmp_path / "x")])


def test_pair_windows_hold_whole_pairs_and_label_each_sequence(prepared):
    from titan_lightning.data.pair_windows import PairWindows

    shards = ShardSet(prepared / "shards")
    docs = _documents(shards)
    lengths = [len(docs[2 * k][0]) + len(docs[2 * k + 1][0]) for k in range(4)]
    seq_len = max(lengths) + min(lengths) - 1  # the longest pair and the shortest fit one window
    windows = PairWindows(shards.tokens, seq_len, 0, "best_fit")
    seen = []
    for i in range(len(windows)):
        sample = windows[i]
        slots = sample["sequence_docs"].tolist()
        pairs = [d for d in slots if d >= 0]
        assert all(pairs[j + 1] == pairs[j] + 1 and pairs[j] % 2 == 0 for j in range(0, len(pairs), 2))
        for slot, doc in enumerate(pairs):  # each slot's labels are its document's supervised tokens
            ids, mask = docs[doc]
            labels = sample["labels"][sample["sequence_ids"] == slot]
            assert labels.tolist() == ids[1:][mask[1:] == 1].tolist()
        seen += pairs
    assert sorted(seen) == list(range(8))
    assert len(windows) < 4  # pairs share windows
    # A span that starts with a rejected answer (a split between the two) leaves that pair out.
    start = int(shards.document_ends()[2])
    tail = PairWindows(type(shards.tokens)(shards, start, len(shards)), seq_len, 0, "packed")
    assert sorted(d for i in range(len(tail)) for d in tail[i]["sequence_docs"].tolist() if d >= 0) == [4, 5, 6, 7]


def _ours(folder: Path):
    """Our decoder of ``folder`` for packed pairs (block-causal, positions per document), its head
    applied by the chunked loss."""
    from titan_lightning.models.common.decoder import decoder_class
    from titan_lightning.pretrained import read_hf_model

    hf = read_hf_model(folder)
    args = replace(hf.args, mask="block_causal", positions="per_document")
    model = decoder_class(type(args))(args)
    model.init_weights(seed=1)
    hf.module_class.hf_adapter(args, tie_word_embeddings=hf.tie_word_embeddings).load_into(model, folder)
    model.head_in_loss = True
    return model, hf.module_class.hf_adapter(args, tie_word_embeddings=hf.tie_word_embeddings)


def _token_losses(model, batch):
    h = model(batch["input_ids"], batch["position_ids"])
    return model.output(h, labels=batch["labels"], chunks=3, reduction="none")


def _theirs_logps(model, docs) -> torch.Tensor:
    """Each document's summed log-probability of its supervised tokens, the transformers model run on
    the document alone, its full logits in fp32."""
    out = []
    for ids, mask in docs:
        ids_t = torch.from_numpy(ids).unsqueeze(0)
        logps = F.log_softmax(model(ids_t).logits.float(), dim=-1)[0, :-1].gather(1, ids_t[0, 1:, None])[:, 0]
        out.append((logps * torch.from_numpy(mask[1:] == 1)).sum())
    return torch.stack(out)


def _theirs_loss(loss: str, beta: float, gamma: float, logps, tokens, ref) -> torch.Tensor:
    """The losses as TRL writes them (DPOTrainer sigmoid / ipo, CPOTrainer simpo), averaged over the pairs."""
    if loss in ("ipo", "simpo"):
        logps, ref = logps / tokens, ref / tokens
    pi, ref_diff = logps[0::2] - logps[1::2], ref[0::2] - ref[1::2]
    if loss == "dpo":
        return -F.logsigmoid(beta * (pi - ref_diff)).mean()
    if loss == "ipo":
        return ((pi - ref_diff - 1 / (2 * beta)) ** 2).mean()
    return -F.logsigmoid(beta * (pi - gamma / beta)).mean()


@pytest.fixture(scope="module")
def step_one(prepared):
    """The pairs as windows (one batch), both sides' reference log-probabilities (ours from our
    reference pass over the windows, theirs from the transformers reference on each sequence alone),
    both policies."""
    import transformers
    from torch.utils.data import default_collate

    from titan_lightning.data.pair_windows import PairWindows
    from titan_lightning.objectives.preference import reference_pass

    shards = ShardSet(prepared / "shards")
    docs = _documents(shards)
    windows = PairWindows(shards.tokens, POSITIONS - 1, 0, "best_fit")
    batch = default_collate([windows[i] for i in range(len(windows))])
    reference_model, _ = _ours(prepared / "reference")
    ours = reference_pass(lambda b: _token_losses(reference_model, b), [batch], len(docs), torch.device("cpu"))
    their_reference = transformers.AutoModelForCausalLM.from_pretrained(prepared / "reference", dtype=torch.float32)
    with torch.no_grad():
        theirs = _theirs_logps(their_reference, docs)
    policy = transformers.AutoModelForCausalLM.from_pretrained(prepared / "policy", dtype=torch.float32)
    return docs, batch, ours.float(), theirs, _ours(prepared / "policy"), policy


@pytest.mark.parametrize("loss", ["dpo", "ipo", "simpo"])
def test_step_one_loss_and_gradients_equal_transformers_on_each_sequence_alone(step_one, loss):
    from titan_lightning.objectives.preference import batch_sums

    docs, batch, reference, ref, (ours, adapter), theirs = step_one
    assert torch.allclose(reference, ref, rtol=0, atol=2e-5), (reference, ref)
    config = PreferenceConfig(loss=loss)
    ours.zero_grad(set_to_none=True)
    theirs.zero_grad(set_to_none=True)
    total, stats = batch_sums(config, _token_losses(ours, batch), batch, reference)
    pairs = stats[0]
    (total / pairs).backward()
    tokens = torch.tensor([float((m[1:] == 1).sum()) for _, m in docs])
    want = _theirs_loss(loss, config.scale, config.gamma, _theirs_logps(theirs, docs), tokens, ref)
    want.backward()

    assert pairs.item() == 4
    # 1e-6, relative to values over 1 (IPO's squared margin is ~25 at step 1: fp32 holds 7 digits).
    assert abs(total.item() / 4 - want.item()) <= 1e-6 * max(1.0, abs(want.item())), (total.item() / 4, want.item())
    our_grads = adapter.to_hf({name: p.grad for name, p in ours.named_parameters()})
    for name, p in theirs.named_parameters():
        scale = p.grad.abs().max().item()
        assert scale > 0, name
        # Relative to the tensor's largest gradient: each is a sum over ~600 tokens' terms in fp32, in
        # another order (packed windows, chunks) than transformers' (IPO's gradients reach ~2).
        assert (our_grads[name] - p.grad).abs().max().item() <= 2e-6 * max(1.0, scale), name


@pytest.fixture(scope="module")
def pairs_run(tmp_path_factory):
    """recipes.hf:dpo in one process (gradient accumulation over 4 windows a step) on 16 pairs of
    very uneven lengths, its folders for other layouts."""
    import preference_cases as cases

    root = tmp_path_factory.mktemp("dpo")
    folder, data = cases.make_folders(root)
    return root, folder, data, cases.dpo_run(folder=str(folder), data=str(data), run_dir=str(root / "one"))


def _assert_same_steps(got: dict, want: dict, rtol: float = 2e-5) -> None:
    assert len(got["steps"]) == len(want["steps"]) == 2
    for g, w in zip(got["steps"], want["steps"]):
        for name, value in w.items():
            assert abs(g[name] - value) <= rtol * max(abs(value), 1.0), (name, g[name], value)
    assert want["val"] and set(got["val"]) == set(want["val"])
    for name, value in want["val"].items():
        assert abs(got["val"][name] - value) <= rtol * max(abs(value), 1.0), (name, got["val"][name], value)


def test_recipes_hf_dpo_logs_trl_s_metrics_and_keeps_the_reference_next_to_the_shards(pairs_run):
    from titan_lightning.objectives.preference import METRICS, REFERENCE_FOLDER

    root, folder, data, one = pairs_run
    first, second = one["steps"]
    # Step 1: the policy is the reference (the same weights, the same windows): DPO's log 2, no margin.
    assert first["train/loss"] == pytest.approx(math.log(2), abs=1e-6)
    assert first["train/rewards/chosen"] == 0 and first["train/rewards/margins"] == 0
    assert first["train/pairs"] >= 4 and second["train/loss"] != first["train/loss"]
    assert {f"val/{name}" for name in METRICS} | {"val/loss", "val/pairs"} <= set(one["val"])
    assert "val/ppl" not in one["val"]
    (cache,) = (data / REFERENCE_FOLDER).glob("*.npy")
    assert np.load(cache).shape == (ShardSet(data).index["documents"],)


@pytest.mark.multi_process
def test_dp_shard_2_with_accumulation_equals_one_process_on_pairs_of_uneven_lengths(pairs_run, tmp_path):
    """2 gloo ranks, 2 windows each a step: the loss is the mean over the step's pairs on every layout."""
    import os

    from titan_lightning.testing.spawn import run_function

    root, folder, data, one = pairs_run
    path = os.pathsep.join(filter(None, [str(Path(__file__).parent), os.environ.get("PYTHONPATH")]))
    ranks = run_function("preference_cases:dpo_run", 2, out_dir=tmp_path / "spawn", timeout=300,
                         env={"PYTHONPATH": path}, init_process_group=False, folder=str(folder), data=str(data),
                         run_dir=str(tmp_path / "two"))
    for rank in ranks:
        _assert_same_steps(rank, one)


@pytest.mark.parametrize("change, message", [
    ({"data.sft": False}, "preference.loss='dpo' trains on the loss masks of pairs"),
    ({"data.sft_packing": "padded"}, "packs each pair whole into a window"),
    ({"parallelism.pp": 2, "preference.reference": "adapters_off"},
     "preference.reference='adapters_off' with parallelism.pp=2: that reference's forward runs inside the last "
     "stage's loss"),
    ({"preference.reference": "adapters_off"}, "lora.rank=0 adds none"),
    ({"preference.reference": "frozen", "lora.rank": 8, "lora.quantize_base": "nf4"},
     "preference.reference='frozen' with lora.quantize_base='nf4' would keep a second NF4 base"),
])
def test_a_preference_job_that_cannot_run_is_refused_naming_the_field(change, message):
    from recipes.tests import features
    from titan_lightning.config import ConfigError
    from titan_lightning.config.validation import validate_preference

    job = features.llama3_small().job
    job.data.sft, job.model.mask, job.model.positions = True, "block_causal", "per_document"
    job.preference.loss = "dpo"
    for dotted, value in change.items():
        section, name = dotted.split(".")
        setattr(getattr(job, section), name, value)
    with pytest.raises(ConfigError, match=re.escape(message)):
        validate_preference(job, world_size=2)


def test_a_set_of_pairs_is_read_by_a_preference_run_only(prepared):
    from titan_lightning.data.preference import check_pairs

    index = ShardSet(prepared / "shards").index
    with pytest.raises(ValueError, match="preference.loss=None would train on the rejected answers too"):
        check_pairs(index, None, "data.dataset_path", "x")
    with pytest.raises(ValueError, match="holds no preference pairs"):
        check_pairs({"sft": {"train_on": "assistant"}}, "dpo", "data.dataset_path", "x")
    check_pairs(index, "simpo", "data.dataset_path", "x")


def test_a_frozen_copy_of_the_starting_model_is_the_precomputed_reference(pairs_run):
    import preference_cases as cases

    root, folder, data, one = pairs_run
    frozen = cases.dpo_run(folder=str(folder), data=str(data), run_dir=str(root / "frozen"), reference="frozen")
    _assert_same_steps(frozen, one, rtol=1e-6)


def test_with_lora_the_base_with_adapters_off_is_the_precomputed_reference(pairs_run):
    """LoRA's B starts at zero: the starting model is its base, so the reference computed each step
    with the adapters off gives the losses of the one precomputed before training, step after step."""
    import preference_cases as cases

    root, folder, data, _ = pairs_run
    runs = [cases.dpo_run(folder=str(folder), data=str(data), run_dir=str(root / reference), lora_rank=4,
                          microbatches=2, reference=reference) for reference in ("precomputed", "adapters_off")]
    _assert_same_steps(runs[1], runs[0], rtol=1e-6)
    assert runs[0]["steps"][1]["train/rewards/margins"] != 0  # the adapters moved the policy off its reference


def test_compiled_in_bf16_the_reference_forward_is_the_policy_s_at_step_one_bit_for_bit(pairs_run):
    """Inductor fuses a block's training forward and its no_grad forward (the reference's) differently;
    rounding each bf16 intermediate as eager does (compile_blocks' eager_rounding, on for a run with a
    reference) makes them the same bits: with the adapters at B = 0 the step-1 margins are exactly 0
    and the loss exactly ln 2 (run 6 on an H200 read 0.6948 without it)."""
    import preference_cases as cases

    root, folder, data, _ = pairs_run
    got = cases.dpo_run(folder=str(folder), data=str(data), run_dir=str(root / "compiled"), lora_rank=4,
                        microbatches=2, steps=1, reference="adapters_off", compiled_bf16=True)
    first = got["steps"][0]
    assert first["train/rewards/margins"] == 0 and first["train/rewards/chosen"] == 0
    assert first["train/loss"] == torch.tensor(math.log(2)).item()


@pytest.mark.parametrize("base", ["bf16", "nf4"])
def test_recipes_hf_dpo_lora_trains_the_adapters_against_its_base_and_exports_them_for_peft(pairs_run, tmp_path,
                                                                                           monkeypatch, base):
    """The user's command: the reference is the base with the adapters off (step 1 is DPO's log 2 with
    no precomputed pass: nothing new next to the shards), only the adapters train, and the export
    holds PEFT's adapter folder of TRL's defaults next to the merged model; on an NF4 base too (QLoRA DPO)."""
    import csv

    from safetensors.torch import load_file

    from titan_lightning.cli import main
    from titan_lightning.objectives.preference import REFERENCE_FOLDER
    from titan_lightning.trainer import RUN_DIR_ENV

    root, folder, data, _ = pairs_run
    cached = sorted((data / REFERENCE_FOLDER).iterdir())
    monkeypatch.setenv(RUN_DIR_ENV, str(tmp_path / "run"))
    assert main(["fit", "--recipe", "recipes.hf:dpo_lora", "--job.checkpoint.initial_load_path", str(folder),
                 "--job.data.dataset_path", str(data), "--trainer.accelerator", "cpu", "--trainer.max_steps", "2",
                 "--trainer.max_epochs", "-1", "--trainer.enable_progress_bar", "false", "--job.data.val_fraction", "0",
                 "--job.training.tokens_per_microbatch_per_dp_rank", "256", "--job.training.tokens_per_step", "512",
                 "--job.optimizer.lr", "1e-3", "--trainer.log_every_n_steps", "1",
                 *(["--job.lora.quantize_base", "nf4"] if base == "nf4" else [])]) == 0
    rows = [r for r in csv.DictReader(open(next((tmp_path / "run").rglob("metrics.csv")))) if r.get("train/loss")]
    assert float(rows[0]["train/loss"]) == pytest.approx(math.log(2), abs=1e-6)
    assert float(rows[1]["train/rewards/margins"]) != 0  # the adapters moved the policy off its base
    assert sorted((data / REFERENCE_FOLDER).iterdir()) == cached
    adapter = tmp_path / "run" / "export_hf" / "adapter"
    config = json.loads((adapter / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"]) == (16, 32)
    assert set(config["target_modules"]) == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                             "down_proj"}
    assert all(".lora_" in k for k in load_file(adapter / "adapter_model.safetensors"))


@pytest.mark.parametrize("reference", ["precomputed", "frozen"])
def test_resuming_without_the_starting_model_s_reference_stops_naming_it(reference, tmp_path):
    """A resumed run's model is the checkpoint's: a reference from it would be wrong. The precomputed
    one is read back from next to the shards; without that file, or with a frozen copy (never in a
    checkpoint), the run stops saying so."""
    from types import SimpleNamespace

    from recipes.tests import features

    run = features.llama3_small()
    job = run.job
    job.preference.loss, job.preference.reference = "dpo", reference
    job.data.dataset_path = str(tmp_path)
    module = type(run.module)(job)
    module._trainer = SimpleNamespace(ckpt_path="runs/x/checkpoints/step-2")
    what = "is not in the checkpoint" if reference == "frozen" else "reference_logps"
    with pytest.raises(RuntimeError, match=rf"resuming runs/x/checkpoints/step-2: the reference model .*{what}"):
        module.on_fit_start()
