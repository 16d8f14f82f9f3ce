"""Our export of each family loads in transformers as it is, with our logits (fp32): a tiny folder
saved by transformers, read through config.json and our adapter, its weights changed (so the export
is not the input), saved through the adapter with the config.json an export writes."""

import pytest
import torch

from titan_lightning.models.gemma3 import Gemma3StateDictAdapter
from titan_lightning.models.gpt_oss import GptOssStateDictAdapter
from titan_lightning.models.mistral import MistralStateDictAdapter
from titan_lightning.models.olmo2 import Olmo2StateDictAdapter
from titan_lightning.models.phi3 import Phi3StateDictAdapter
from titan_lightning.models.qwen2 import Qwen2StateDictAdapter

from tests.hf_folders import VOCAB, assert_transformers_agrees, export_hf, load_ours, save_hf_model

pytest.importorskip("transformers", reason="the reference implementation; a test-only extra")

TOKENS = torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(0))

# model_type: (adapter, the folder's fields, what transformers reads from the export's config.json
# (a dotted name reads into a dict), rtol = atol of the logits).
EXPORTS = {
    "qwen2": (Qwen2StateDictAdapter, {}, {}, 1e-5),  # the q/k/v biases changed too
    "mistral": (MistralStateDictAdapter, {}, {"model_type": "mistral"}, 1e-5),
    "mixtral": (MistralStateDictAdapter, {}, {"model_type": "mixtral"}, 1e-5),
    "phi3": (Phi3StateDictAdapter, {}, {}, 1e-5),
    "olmo2": (Olmo2StateDictAdapter, {}, {}, 1e-5),
    # A tied folder: the export's output is a tensor of its own (it changed apart from the embeddings).
    "gemma3_text": (Gemma3StateDictAdapter, {"tie": True, "final_logit_softcapping": 3.0},
                    {"tie_word_embeddings": False, "final_logit_softcapping": 3.0}, 1e-5),
    "gpt_oss": (GptOssStateDictAdapter, {}, {"model_type": "gpt_oss", "rope_parameters.rope_type": "yarn"}, 1e-4),
}


def _field(config, name: str):
    value = config
    for part in name.split("."):
        value = value[part] if isinstance(value, dict) else getattr(value, part)
    return value


@pytest.mark.parametrize("model_type", EXPORTS)
def test_our_export_loads_in_transformers(tmp_path, model_type):
    adapter, fields, config, tolerance = EXPORTS[model_type]
    save_hf_model(tmp_path / "hf", model_type, **fields)
    ours = load_ours(tmp_path / "hf")
    with torch.no_grad():  # weights of our own, so the export is not the input
        for p in ours.parameters():
            p.add_(0.05 * torch.randn_like(p))
    export = export_hf(ours, adapter, tmp_path / "export")
    theirs = assert_transformers_agrees(export, ours, TOKENS, rtol=tolerance, atol=tolerance)
    assert {name: _field(theirs.config, name) for name in config} == config
