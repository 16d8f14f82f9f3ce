"""Preference training (#49) against TRL itself: on the pairs and token ids of test_preference.py,
our step-1 DPO and IPO losses and gradients equal those of ``trl.DPOTrainer.compute_loss`` on one
batch of its train dataloader (the transformers model of the same folder, the reference another seed,
no truncation), and so do the metrics it logs (fp32, CPU; IPO's loss takes per-token means, its
metrics the sums, as TRL logs them for every loss)."""

import pytest
import torch

from test_preference import _token_losses, prepared, step_one  # noqa: F401 (fixtures)
from titan_lightning.config.preference import PreferenceConfig

transformers = pytest.importorskip("transformers", reason="the reference implementation; not a project dependency")
trl = pytest.importorskip("trl", reason="TRL's DPOTrainer is the reference for DPO (setup.cfg's dev extra)")
datasets = pytest.importorskip("datasets", reason="TRL's trainers read a datasets.Dataset")


class _TokenizedPairs(trl.DPOTrainer):
    """DPOTrainer on pairs given as token ids: its ``_prepare_dataset`` (TRL 1.16) would render and
    tokenize text; ours are the ids ``prepare --preference`` wrote, taken as they are."""

    def _prepare_dataset(self, dataset, *args, **kwargs):
        return dataset


def _trl_pairs(docs) -> list[dict[str, list[int]]]:
    """Each pair as DPOTrainer's collator reads it: the shared prompt, then each answer up to its last
    supervised token (what follows, "\\n<|endoftext|>", cannot change an earlier token's log-probability)."""
    pairs = []
    for k in range(0, len(docs), 2):
        row = {}
        for side, (ids, mask) in zip(("chosen", "rejected"), docs[k:k + 2]):
            supervised = mask.nonzero()[0]
            start, end = int(supervised[0]), int(supervised[-1]) + 1
            assert mask[start:end].all()  # one answer, after the prompt
            assert row.setdefault("prompt_ids", ids[:start].tolist()) == ids[:start].tolist()
            row[f"{side}_ids"] = ids[start:end].tolist()
        pairs.append(row)
    return pairs


@pytest.mark.parametrize("loss, loss_type", [("dpo", "sigmoid"), ("ipo", "ipo")])
def test_step_one_loss_gradients_and_metrics_equal_trl_dpo_trainer_on_the_same_batch(prepared, step_one, tmp_path,
                                                                                     loss, loss_type):
    from titan_lightning.objectives.preference import METRICS, batch_sums

    docs, batch, reference, _, (ours, adapter), _ = step_one
    config = PreferenceConfig(loss=loss)
    ours.zero_grad(set_to_none=True)
    total, stats = batch_sums(config, _token_losses(ours, batch), batch, reference)
    pairs = stats[0].item()
    (total / pairs).backward()
    assert pairs == len(docs) // 2 == 4

    load = transformers.AutoModelForCausalLM.from_pretrained
    args = trl.DPOConfig(output_dir=str(tmp_path), beta=config.scale, loss_type=loss_type, max_length=None,
                         per_device_train_batch_size=4, report_to=[], use_cpu=True, bf16=False, seed=0)
    trainer = _TokenizedPairs(load(prepared / "policy", dtype=torch.float32),
                              ref_model=load(prepared / "reference", dtype=torch.float32), args=args,
                              train_dataset=datasets.Dataset.from_list(_trl_pairs(docs)),
                              processing_class=transformers.AutoTokenizer.from_pretrained(prepared / "policy"))
    (their_batch,) = trainer.get_train_dataloader()
    # The whole set in one batch, its supervised tokens exactly ours.
    assert their_batch["completion_mask"].sum().item() == sum(int((m[1:] == 1).sum()) for _, m in docs)
    trainer.model.train()
    want = trainer.compute_loss(trainer.model, their_batch)
    want.backward()
    trainer.log({})
    logged = trainer.state.log_history[-1]

    # 1e-6, relative to values over 1 (IPO's squared margin is ~26 at step 1: fp32 holds 7 digits).
    assert abs(total.item() / pairs - want.item()) <= 1e-6 * max(1.0, abs(want.item())), (total.item() / pairs, want)
    our_grads = adapter.to_hf({name: p.grad for name, p in ours.named_parameters()})
    for name, p in trainer.model.named_parameters():
        scale = p.grad.abs().max().item()
        assert scale > 0, name
        # Relative to the tensor's largest gradient, as in test_preference.py (sums in another order).
        assert (our_grads[name] - p.grad).abs().max().item() <= 2e-6 * max(1.0, scale), name
    # Each log-probability is a sum over ~40 tokens (~150 in size: fp32 holds it to ~1e-5), each reward
    # beta times a difference of two of them.
    size = abs(logged["logps/chosen"]) + abs(logged["logps/rejected"])
    for name, value in zip(METRICS, (stats[1:] / pairs).tolist()):
        tolerance = 1e-6 * (size if name.startswith("logps") else config.scale * size)
        assert abs(value - logged[name]) <= tolerance, (name, value, logged[name])
