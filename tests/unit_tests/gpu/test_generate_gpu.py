"""``titan-lightning generate`` on one GPU (titan_lightning/generate.py): in fp32 (TF32 off) the greedy
tokens of the KV-cache decoding are transformers' on the same folder, as on the CPU; in bf16 (the
GPU's default) each cached step's logits are those of the whole sequence recomputed, within bf16's
error; the command runs with ``--device cuda`` and says its speed."""

import pytest
import torch

from titan_lightning import cli
from titan_lightning.generate import Sampling, Session, find_model, generate_tokens

from tests.hf_folders import save_hf_folder

pytestmark = pytest.mark.gpu
transformers = pytest.importorskip("transformers", reason="the reference implementation; a test-only extra")

PROMPT = [17, 42, 101, 7, 230, 64, 5, 99, 150, 33, 12, 280]
FAMILIES = [("qwen3", {}), ("qwen3_moe", {}), ("mistral", {"sliding_window": 8}), ("gpt_oss", {}),
            ("gemma3_text", {})]


@pytest.fixture(autouse=True)
def _no_tf32():
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


@pytest.mark.parametrize("model_type, overrides", FAMILIES)
def test_fp32_greedy_tokens_are_transformers(tmp_path, model_type, overrides):
    save_hf_folder(tmp_path, model_type, **overrides)
    reference = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).cuda().eval()
    with torch.no_grad():
        out = reference.generate(torch.tensor([PROMPT], device="cuda"), max_new_tokens=32, do_sample=False,
                                 eos_token_id=None, pad_token_id=0)
    model = find_model(str(tmp_path)).load(torch.device("cuda"), torch.float32)
    with Session(model) as session:
        ours = list(generate_tokens(session, PROMPT, Sampling(max_new_tokens=32)))
    assert ours == out[0, len(PROMPT):].tolist()


@pytest.mark.parametrize("model_type, overrides", FAMILIES)
def test_bf16_cached_steps_are_the_whole_sequence(tmp_path, model_type, overrides):
    save_hf_folder(tmp_path, model_type, **overrides)
    model, again = (find_model(str(tmp_path)).load(torch.device("cuda"), torch.bfloat16) for _ in range(2))
    assert model.tok_embeddings.weight.dtype == torch.bfloat16 and model.rope_cache.dtype == torch.float32
    ids = list(PROMPT)
    with Session(model) as session, torch.inference_mode():  # (``again`` has no cache: the whole sequence)
        for _ in range(24):
            cached = session.next_logits(ids).float()
            whole = again.output(again(torch.tensor([ids], device="cuda"))[0, -1]).float()
            torch.testing.assert_close(cached, whole, rtol=0.05, atol=0.05 * whole.abs().max().item())
            ids.append(int(whole.argmax()))


def test_the_command_runs_on_cuda(tmp_path, capsys):
    save_hf_folder(tmp_path, "qwen3")
    code = cli.main(["generate", "--model", str(tmp_path), "--prompt", "Once upon a time", "--device", "cuda",
                     "--max-new-tokens", "16", "--temperature", "0.8"])
    out, err = capsys.readouterr()
    assert code == 0 and out.strip() and "tokens/s" in err
