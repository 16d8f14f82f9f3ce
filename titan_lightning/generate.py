"""``titan-lightning generate`` and ``titan-lightning chat``: try a model with our own decoder, on
CPU or one GPU, with no export.

    titan-lightning generate --model PATH --prompt "Once upon a time" [--max-new-tokens N]
        [--temperature T] [--top-p P] [--top-k K] [--seed S] [--greedy] [--device cuda] [--dtype bfloat16]
    titan-lightning chat --model PATH [--system "You are ..."] [--base DIR]

``PATH`` is a Hugging Face folder (config.json, safetensors, tokenizer files), a PEFT adapter folder
(adapter_config.json and adapter_model.safetensors, as PEFT, TRL, axolotl or Unsloth save a LoRA:
its adapters on our model of its base, the Hugging Face folder its base_model_name_or_path names or
``--base DIR``; the tokenizer, chat template and generation settings the adapter folder holds, else
the base's; titan_lightning/lora/peft_import.py says what is refused), a run folder
(``runs/<name>/<time>``, or ``runs/<name>`` for its newest run: the run's Hugging Face export
when it wrote one, else its sharded export, else its newest checkpoint), or a checkpoint folder.
A checkpoint holds weights, not the model they belong to: its job comes from the run's
config.yaml (the run as --print_config prints it, written into the run folder at launch), with
any ``--job.``/``--trainer.`` options given after ours applied on top; or, given instead, from
the run's own options (``--recipe recipes.hf:sft --job.checkpoint.initial_load_path DIR ...``,
or ``--config run.yaml``), as when resuming it.

Sampling follows the folder's generation_config.json (``do_sample``, ``temperature``, ``top_k``,
``top_p``, ``max_new_tokens``, ``eos_token_id``), with transformers' defaults for what it leaves out
(greedy; 1.0, 50, 1.0 when sampling); a sampling flag turns sampling on, ``--greedy`` off. Generation
stops at an id of ``eos_token_id`` (the end of turn of chat models) or after ``--max-new-tokens``.

Decoding keeps each attention layer's keys and values (models/common/kv_cache.py): the prompt is
fed once, then one token per step; chat feeds only what each turn adds to the conversation. A
model whose attention takes no cache (DeepSeek V3's latent attention) recomputes the whole
sequence at each step instead. Tokens are printed as they come (decoded incrementally, so a
character spread over several tokens prints whole).

``chat`` renders the conversation with the folder's chat template (its generation prompt added)
as transformers' ``apply_chat_template`` does (data/chat.py), reads one user line at a time, and
ends at ``/exit`` or the end of its input.
"""

import argparse
import sys
import time
import warnings
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Iterator, Optional, Sequence

import torch

from titan_lightning.checkpoint import DCP_METADATA, latest_checkpoint, load_sharded
from titan_lightning.config import ConfigError
from titan_lightning.data.chat import compile_template, read_chat_template
from titan_lightning.data.tokenizer import Tokenizer, load_tokenizer
from titan_lightning.lora import add_job_adapters, base_only, quantize_base_nf4
from titan_lightning.lora.peft_import import (is_peft_folder, load_peft_tensors, lora_config, peft_base, peft_tensors,
                                              read_adapter_config)
from titan_lightning.models.common.decoder import decoder_class
from titan_lightning.models.common.hf_config import CONFIG_FILE, read_json_object
from titan_lightning.models.common.kv_cache import KVCache, cached_attentions
from titan_lightning.models.common.moe import reset_moe_buffers
from titan_lightning.pretrained import GENERATION_FILE, read_hf_model
from titan_lightning.trainer import RUN_CONFIG

COMMANDS = ("generate", "chat")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
# transformers' GenerationConfig defaults, for what a generation_config.json leaves out.
HF_DEFAULTS = {"do_sample": False, "temperature": 1.0, "top_k": 50, "top_p": 1.0}
MAX_NEW_TOKENS = 256
EXIT = "/exit"


class GenerateError(ConfigError):
    """Bad input to generate / chat: one line, exit 2."""


# -- what to sample -------------------------------------------------------------------------


@dataclass(kw_only=True)
class Sampling:
    """How each next token is picked: the most likely one (``do_sample`` False), or drawn from the
    logits divided by ``temperature``, cut to the ``top_k`` most likely (0: all), then to the
    fewest whose probabilities sum to ``top_p``, as transformers' processors do, in that order."""

    do_sample: bool = False
    temperature: float = 1.0
    top_k: int = 50
    top_p: float = 1.0
    max_new_tokens: int = MAX_NEW_TOKENS
    eos_ids: frozenset[int] = field(default_factory=frozenset)

    def __post_init__(self) -> None:
        problem = sampling_problem(self.temperature, self.top_k, self.top_p) if self.do_sample else None
        if problem is None and self.max_new_tokens < 1:
            problem = f"max_new_tokens={self.max_new_tokens}: must be >= 1"
        if problem is not None:
            raise GenerateError(problem)

    def pick(self, logits: torch.Tensor, generator: Optional[torch.Generator] = None) -> int:
        """The next token of ``logits`` [vocab]."""
        logits = logits.float()
        if not self.do_sample:
            return int(logits.argmax())
        logits = logits / self.temperature
        if 0 < self.top_k < logits.numel():
            logits = logits.masked_fill(logits < logits.topk(self.top_k).values[-1], float("-inf"))
        if self.top_p < 1:
            ordered, order = logits.sort(descending=True)
            probs = ordered.softmax(-1)
            drop = probs.cumsum(-1) - probs >= self.top_p  # the mass before the token already reaches top_p
            logits = logits.index_put((order[drop],), torch.tensor(float("-inf"), device=logits.device))
        probs = logits.softmax(-1)
        return int(torch.multinomial(probs.cpu(), 1, generator=generator))


def sampling_problem(temperature: Optional[float], top_k: Optional[int], top_p: Optional[float]) -> Optional[str]:
    """What is wrong with these settings (None: each is unset or valid)."""
    if temperature is not None and not temperature > 0:
        return f"temperature={temperature}: must be > 0 (greedy decoding is --greedy, or do_sample false)"
    if top_k is not None and top_k < 0:
        return f"top_k={top_k}: must be >= 0 (0 keeps every token)"
    if top_p is not None and not 0 < top_p <= 1:
        return f"top_p={top_p}: must be in (0, 1]"
    return None


def check_flags(options: argparse.Namespace) -> None:
    """The sampling flags' ranges, before anything is read; one line naming the flag."""
    problem = sampling_problem(options.temperature, options.top_k, options.top_p)
    if problem is None and options.max_new_tokens is not None and options.max_new_tokens < 1:
        problem = f"max_new_tokens={options.max_new_tokens}: must be >= 1"
    if problem is not None:
        name, rest = problem.split("=", 1)
        raise GenerateError(f"--{name.replace('_', '-')}={rest}")


def read_sampling(folder: Optional[Path], options: argparse.Namespace, fallback_eos: int) -> Sampling:
    """The folder's generation_config.json (transformers' defaults for what it lacks, config.json's
    eos_token_id, else the tokenizer's end-of-text id), then the command line's flags."""
    settings: dict[str, Any] = {}
    if folder is not None and (folder / GENERATION_FILE).is_file():
        settings = read_json_object(folder / GENERATION_FILE)
    eos = settings.get("eos_token_id")
    if eos is None and folder is not None and (folder / CONFIG_FILE).is_file():
        eos = read_json_object(folder / CONFIG_FILE).get("eos_token_id")
    eos = [fallback_eos] if eos is None else eos if isinstance(eos, list) else [eos]
    values = {name: settings.get(name) if settings.get(name) is not None else default
              for name, default in HF_DEFAULTS.items()}
    values["max_new_tokens"] = settings.get("max_new_tokens") or MAX_NEW_TOKENS
    flags = {"temperature": options.temperature, "top_k": options.top_k, "top_p": options.top_p}
    values.update({name: value for name, value in flags.items() if value is not None})
    if any(value is not None for value in flags.values()):
        values["do_sample"] = True
    if options.greedy:
        values["do_sample"] = False
    if options.max_new_tokens is not None:
        values["max_new_tokens"] = options.max_new_tokens
    try:
        return Sampling(**values, eos_ids=frozenset(int(i) for i in eos))
    except (GenerateError, TypeError) as err:  # (the flags are checked first: this is the folder's setting)
        raise GenerateError(f"{folder / GENERATION_FILE}: {err}; override it with the flag or --greedy") from None


# -- decoding -------------------------------------------------------------------------------


class Session:
    """A model decoding one sequence: ``next_logits(ids)`` feeds only what ``ids`` adds to what was
    fed before (the caches rewound to the longest common prefix). As a context manager it gives
    every attention layer a ``KVCache`` and takes them back at the end."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.max_len: int = model.args.max_seq_len
        self.attentions = cached_attentions(model)
        self.fed: list[int] = []

    def __enter__(self) -> "Session":
        for attention in self.attentions or ():
            attention.kv_cache = KVCache(self.max_len)
        return self

    def __exit__(self, *exc) -> None:
        for attention in self.attentions or ():
            attention.kv_cache = None

    @torch.inference_mode()
    def next_logits(self, ids: Sequence[int]) -> torch.Tensor:
        """Logits [vocab] of the token after ``ids``."""
        if len(ids) > self.max_len:
            raise GenerateError(f"{len(ids)} tokens do not fit the model's {self.max_len} positions")
        start = 0
        if self.attentions is not None:  # (else: the whole sequence again, every step)
            start = len(self.fed)  # the common prefix: usually all that was fed (one more token, a next turn)
            if list(ids[:start]) != self.fed:
                start = next((i for i, (a, b) in enumerate(zip(self.fed, ids)) if a != b), min(start, len(ids)))
            start = min(start, len(ids) - 1)
            for attention in self.attentions:
                attention.kv_cache.rewind(start)
        device = self.model.tok_embeddings.weight.device
        h = self.model(torch.tensor([list(ids[start:])], device=device))
        self.fed = list(ids)
        return self.model.output(h[0, -1])


def generate_tokens(session: Session, prompt: Sequence[int], sampling: Sampling,
                    generator: Optional[torch.Generator] = None) -> Iterator[int]:
    """The tokens after ``prompt``, one at a time; the last is an end-of-sequence id when one came
    before ``max_new_tokens`` (or the model's positions) ran out."""
    ids = list(prompt)
    for _ in range(min(sampling.max_new_tokens, session.max_len - len(ids) + 1)):
        token = sampling.pick(session.next_logits(ids), generator)
        yield token
        if token in sampling.eos_ids:
            return
        ids.append(token)


class TextStream:
    """Generated ids to text as they come: each ``push`` returns the text the new id completes
    (nothing while it ends inside a character several byte-level tokens spell)."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer, self.ids, self.shown = tokenizer, [], 0

    def push(self, token: int) -> str:
        self.ids.append(token)
        text = self.tokenizer.decode(self.ids)
        if text.endswith("\ufffd"):
            return ""
        new, self.shown = text[self.shown:], len(text)
        return new

    def end(self) -> str:
        """What is left unprinted (an unfinished character, as the replacement character)."""
        text = self.tokenizer.decode(self.ids)
        new, self.shown = text[self.shown:], len(text)
        return new


def prompt_ids(tokenizer: Tokenizer, text: str) -> list[int]:
    """``text`` as the model is given it: BOS first when the tokenizer adds one (as transformers'
    tokenizer call does), no end-of-text."""
    return ([tokenizer.bos_id] if tokenizer.add_bos else []) + tokenizer.encode(text)


# -- the model and its folder ---------------------------------------------------------------


@dataclass
class Loaded:
    """What ``--model PATH`` names: the model's args, where its weights, tokenizer, chat template and
    generation settings are; ``model`` once ``load`` has built it."""

    args: Any
    weights: Path
    adapter: Optional[Any]  # the family's Hugging Face adapter; None: a checkpoint of ours
    tokenizer: Tokenizer
    tokenizer_path: Optional[str]
    settings_folder: Optional[Path]
    model: Optional[torch.nn.Module] = None
    # A LoRA run's checkpoint (its job's ``lora``): the adapters it holds go on the base model of
    # ``checkpoint.initial_load_path``.
    lora: Optional[Any] = None
    base_folder: Optional[Path] = None
    # A PEFT adapter folder's (lora/peft_import.py): its adapters as our parameters, on ``base_folder``.
    peft: Optional[dict[str, torch.Tensor]] = None

    def load(self, device: torch.device, dtype: torch.dtype) -> torch.nn.Module:
        """Our decoder with the weights, in eval mode on ``device``."""
        model = _build(self.args, device, dtype)
        if self.peft is not None:
            _load_base_with_adapters(model, self.lora, self.base_folder)
            load_peft_tensors(model, self.peft)
        elif self.adapter is not None:
            self.adapter.load_into(model, self.weights)
        else:
            if self.lora is not None:
                _load_base_with_adapters(model, self.lora, self.base_folder)
            state = {f"model.{k}": t for k, t in model.state_dict().items() if self.lora is None or ".lora_" in k}
            with warnings.catch_warnings():  # "torch.distributed is ... uninitialized ... a single process": so it is
                warnings.filterwarnings("ignore", message=".*assuming the intent is to load in a single process")
                load_sharded(self.weights, {"state_dict": state})
        self.model = model.eval()
        return self.model


def _load_base_with_adapters(model: torch.nn.Module, lora: Any, folder: Optional[Path]) -> None:
    """``model`` with ``lora``'s adapters (their values left to the checkpoint), its base loaded from
    the Hugging Face ``folder`` the run started from (NF4, as it trained, for QLoRA)."""
    if folder is None:
        raise GenerateError(f"--model: a checkpoint of a LoRA run (lora.rank={lora.rank}) holds its adapters alone; "
                            f"give the run's --job.checkpoint.initial_load_path (its base Hugging Face folder)")
    adapter = _family_adapter(read_hf_model(folder))
    add_job_adapters(model, lora, adapter)
    if lora.quantize_base == "nf4":  # (the base it trained on: the folder's weights quantized as they load)
        quantize_base_nf4(model, next(model.parameters()).device)
    with base_only(model) as base:
        adapter.load_into(base, folder)


def _family_adapter(hf: Any) -> Any:
    return hf.module_class.hf_adapter(hf.args, tie_word_embeddings=hf.tie_word_embeddings)


def resolve_model_path(path: str) -> tuple[str, Path]:
    """("hf", folder), ("peft", folder) or ("checkpoint", folder) for ``--model PATH``; one line when it
    is none of them."""
    folder = Path(path)
    if not folder.exists():
        raise GenerateError(f"--model={path!r}: no such folder; give a Hugging Face model folder, a PEFT adapter "
                            f"folder, a run folder (runs/<name>/<time>) or a checkpoint folder")
    if not folder.is_dir():
        raise GenerateError(f"--model={path!r} is a file; give a folder")
    if is_peft_folder(folder):  # (before config.json: some tools save the base's config.json beside the adapter)
        return "peft", folder
    if (folder / CONFIG_FILE).is_file():
        return "hf", folder
    if (folder / DCP_METADATA).is_file():
        return "checkpoint", folder
    runs = [folder] + sorted((p for p in folder.iterdir() if p.is_dir()), reverse=True)  # (runs/<name>: newest time)
    for run in runs:
        if (run / "export_hf" / CONFIG_FILE).is_file():
            return "hf", run / "export_hf"
        if (run / "export" / DCP_METADATA).is_file():  # a sharded export (checkpoint.export_format=dcp)
            return "checkpoint", run / "export"
        newest = latest_checkpoint(run / "checkpoints") if (run / "checkpoints").is_dir() else None
        if newest is not None:
            return "checkpoint", newest
    raise GenerateError(f"--model={path!r} holds no config.json (a Hugging Face folder), no adapter_config.json "
                        f"(a PEFT adapter folder), no {DCP_METADATA} (a checkpoint) and no run's export_hf/, export/ "
                        f"or complete checkpoints/")


def find_model(path: str, run_argv: Sequence[str] = (), parse_run: Optional[Callable] = None,
               base: Optional[str] = None) -> Loaded:
    """What ``--model PATH`` names (nothing loaded yet); ``run_argv``: the run's options (a
    checkpoint's job), read with ``parse_run``; ``base``: ``--base``, an adapter folder's base model."""
    kind, folder = resolve_model_path(path)
    if base is not None and kind != "peft":
        raise GenerateError(f"--base={base!r} is for a PEFT adapter folder --model (adapter_config.json); "
                            f"{folder} is not one: leave --base out")
    if kind in ("hf", "peft") and run_argv:
        raise GenerateError(f"unknown option {run_argv[0]!r} (run options such as --recipe are for a "
                            f"checkpoint; {folder} is a {'Hugging Face' if kind == 'hf' else 'PEFT adapter'} folder)")
    if kind == "hf":
        hf = read_hf_model(folder)
        tokenizer_path = str(folder) if (folder / "tokenizer.json").is_file() else None
        return Loaded(hf.args, folder, _family_adapter(hf), _tokenizer(tokenizer_path), tokenizer_path, folder)
    if kind == "peft":
        return _peft_model(folder, base)
    job = _checkpoint_job(folder, list(run_argv), parse_run)
    initial = job.checkpoint.initial_load_path
    settings = Path(initial) if initial is not None and (Path(initial) / CONFIG_FILE).is_file() else None
    tokenizer_path = job.data.tokenizer_path
    if settings is None and tokenizer_path is not None:
        settings = Path(tokenizer_path) if Path(tokenizer_path).is_dir() else Path(tokenizer_path).parent
    lora = job.lora if job.lora.enabled else None
    return Loaded(job.model, folder, None, _tokenizer(tokenizer_path), tokenizer_path, settings, lora=lora,
                  base_folder=Path(initial) if initial is not None else None)


def _peft_model(folder: Path, base: Optional[str]) -> Loaded:
    """A PEFT adapter folder on its base: every field and tensor read and checked against our model
    of the base (built on the meta device); the tokenizer and generation settings the adapter folder
    holds, else the base's."""
    config = read_adapter_config(folder)
    base_folder = _peft_base_folder(folder, peft_base(config), base)
    hf = read_hf_model(base_folder)
    adapter = _family_adapter(hf)
    with torch.device("meta"):
        model = decoder_class(type(hf.args))(hf.args)
    lora = lora_config(config, model, adapter, folder)
    add_job_adapters(model, lora, adapter)
    state = peft_tensors(folder, model, adapter)
    tokenizer_folder = next((f for f in (folder, base_folder) if (f / "tokenizer.json").is_file()), None)
    tokenizer_path = str(tokenizer_folder) if tokenizer_folder is not None else None
    settings = folder if (folder / GENERATION_FILE).is_file() else base_folder
    return Loaded(hf.args, folder, None, _tokenizer(tokenizer_path), tokenizer_path, settings, lora=lora,
                  base_folder=base_folder, peft=state)


def _peft_base_folder(folder: Path, recorded: Optional[str], base: Optional[str]) -> Path:
    """``--base`` when given, else adapter_config.json's ``base_model_name_or_path``: a local Hugging Face
    folder; one line naming both otherwise."""
    given = base if base is not None else recorded
    if given is not None and (Path(given) / CONFIG_FILE).is_file():
        return Path(given)
    if base is not None:
        raise GenerateError(f"--base={base!r} holds no {CONFIG_FILE}; give the Hugging Face folder of the model the "
                            f"adapter {folder} was made on (its adapter_config.json names {recorded!r})")
    raise GenerateError(f"--model={str(folder)!r}: its adapter_config.json's base_model_name_or_path={recorded!r} is "
                        f"not a local Hugging Face folder (no {CONFIG_FILE}) and no --base was given; give --base DIR, "
                        f"the Hugging Face folder of the model the adapter was made on")


def _checkpoint_job(folder: Path, run_argv: list[str], parse_run: Optional[Callable]):
    recorded = run_config(folder)
    if not any(a.startswith(("--recipe", "--config")) for a in run_argv) and recorded is not None:
        try:
            run = parse_run(["--config", str(recorded), *run_argv]) if parse_run is not None else None
        except Exception as err:  # noqa: BLE001 - any failure to read the recorded run is that file's
            message = " ".join(str(err).split())[:300] or type(err).__name__
            raise GenerateError(f"--model: {recorded} (the run's options) cannot be read: {message}; pass the run's "
                                f"options after ours instead (--recipe MOD:FN and its --job overrides)") from None
        return _decoder_job(run)
    if not run_argv or parse_run is None:
        raise GenerateError(f"--model: {folder} is a checkpoint, which holds weights but not the model they belong "
                            f"to, and its run folder has no {RUN_CONFIG}; give the run's options after ours "
                            f"(--recipe MOD:FN and the --job overrides it ran with), or a Hugging Face folder "
                            f"(the run's export_hf)")
    return _decoder_job(parse_run(run_argv))


def run_config(checkpoint: Path) -> Optional[Path]:
    """The config.yaml of the run that wrote ``checkpoint`` (``<run>/checkpoints/<name>`` or
    ``<run>/export``); None when there is none."""
    for folder in (checkpoint.parent, checkpoint.parent.parent):
        if (folder / RUN_CONFIG).exists():
            return folder / RUN_CONFIG
    return None


def _decoder_job(run: Any):
    job = getattr(run.module, "job", None) if run is not None else None
    if job is None or decoder_class(type(job.model)) is None:
        raise GenerateError(f"--recipe: {type(run.module).__name__ if run else None} is not a model of ours "
                            f"(a CausalLMModule of a family): generate has no decoder for it")
    return job


def _build(args: Any, device: torch.device, dtype: torch.dtype) -> torch.nn.Module:
    """The family's decoder of ``args`` on ``device`` in ``dtype``, its weights left to a load; causal
    sdpa attention (a run's document masks and kernels are for training), the final norm's output
    from ``forward`` (``Session`` applies the head to the last token only)."""
    args = replace(args, mask="causal", positions="global", attention="sdpa")
    with torch.device("meta"):
        model = decoder_class(type(args))(args).to(dtype)
    model.to_empty(device=device)
    reset_moe_buffers(model)
    with torch.device("cpu"):
        model.rope_cache = model.build_rope_cache().to(device)
    model.head_in_loss = True
    return model


def _tokenizer(path: Optional[str]) -> Tokenizer:
    try:
        return load_tokenizer(path)
    except (OSError, ValueError) as err:
        raise GenerateError(str(err)) from None


# -- the commands ---------------------------------------------------------------------------


def build_parser(command: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=f"titan-lightning {command}", allow_abbrev=False, exit_on_error=False,
                                     description=__doc__.split("\n\n")[0].replace("``", ""),
                                     epilog="\n\n".join(__doc__.split("\n\n")[2:4]).replace("``", ""),
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="a Hugging Face folder, a PEFT adapter folder, a run folder or a checkpoint "
                                        "folder (required)")
    parser.add_argument("--base", help="an adapter folder's base model (a Hugging Face folder; default: its "
                                       "adapter_config.json's base_model_name_or_path)")
    if command == "generate":
        parser.add_argument("--prompt", help="the text to continue (required)")
    else:
        parser.add_argument("--system", help="a system message opening the conversation")
    parser.add_argument("--max-new-tokens", type=int,
                        help=f"(default: generation_config.json's, else {MAX_NEW_TOKENS})")
    parser.add_argument("--temperature", type=float, help="> 0; sets sampling on")
    parser.add_argument("--top-p", type=float, help="in (0, 1]; sets sampling on")
    parser.add_argument("--top-k", type=int, help=">= 0 (0: every token); sets sampling on")
    parser.add_argument("--greedy", action="store_true", help="the most likely token at each step")
    parser.add_argument("--seed", type=int, default=0, help="the sampling seed (default 0)")
    parser.add_argument("--device", help="cpu or cuda (default: cuda when there is a GPU)")
    parser.add_argument("--dtype", choices=sorted(DTYPES), help="(default: bfloat16 on cuda, float32 on cpu)")
    return parser


def main(command: str, argv: list[str], parse_run: Optional[Callable] = None) -> int:
    """``generate`` or ``chat`` with ``argv``; ``parse_run``: the command line's run parser (cli.py),
    for a checkpoint's job. Bad input raises a one-line error before the model loads."""
    parser = build_parser(command)
    if {"-h", "--help"} & set(argv):
        parser.print_help()
        return 0
    try:
        options, run_argv = parser.parse_known_args(argv)
    except argparse.ArgumentError as err:
        raise GenerateError(f"{command}: {err}") from None
    for name in ("model", "prompt") if command == "generate" else ("model",):
        if getattr(options, name) is None:
            raise GenerateError(f"{command} needs --{name} (titan-lightning {command} --help)")
    unknown = [a for a in run_argv if a.startswith("-") and not a.startswith(("--recipe", "--config", "--job.",
                                                                               "--trainer."))]
    if unknown:
        raise GenerateError(f"{command}: unknown option {unknown[0]!r}; see titan-lightning {command} --help")
    device, dtype = _device(options)
    check_flags(options)
    found = find_model(options.model, run_argv, parse_run, base=options.base)
    sampling = read_sampling(found.settings_folder, options, found.tokenizer.eot_id)
    generator = torch.Generator().manual_seed(options.seed)
    try:
        if command == "generate":
            ids = prompt_ids(found.tokenizer, options.prompt)
            if len(ids) >= found.args.max_seq_len:
                raise GenerateError(f"--prompt is {len(ids)} tokens; the model takes at most {found.args.max_seq_len} "
                                    f"(max_position_embeddings), with room for what it generates")
            found.load(device, dtype)
            return _generate(found, ids, sampling, generator)
        render = chat_template(found)
        render([{"role": "user", "content": "Hi."}])  # a template that fails on the first turn: before the load
        found.load(device, dtype)
        return chat(found, render, sampling, generator, system=options.system)
    except KeyboardInterrupt:  # Ctrl-C: the end of the session, not an error
        _print("\n")
        return 130


def _device(options: argparse.Namespace) -> tuple[torch.device, torch.dtype]:
    name = options.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if name not in ("cpu", "cuda") and not name.startswith("cuda:"):
        raise GenerateError(f"--device={name!r}: expected cpu or cuda (one GPU: cuda or cuda:N)")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise GenerateError(f"--device={name!r}: no GPU is visible to torch here; use --device cpu")
    device = torch.device(name)
    dtype = DTYPES[options.dtype] if options.dtype else torch.bfloat16 if device.type == "cuda" else torch.float32
    return device, dtype


def _generate(loaded: Loaded, ids: list[int], sampling: Sampling, generator: torch.Generator) -> int:
    """Print what follows the prompt's ``ids`` as it comes; its speed on stderr."""
    tokenizer = loaded.tokenizer
    stream, started, count = TextStream(tokenizer), time.perf_counter(), 0
    with Session(loaded.model) as session:
        for token in generate_tokens(session, ids, sampling, generator):
            count += 1
            if token not in sampling.eos_ids:
                _print(stream.push(token))
    _print(stream.end() + "\n")
    seconds = time.perf_counter() - started
    print(f"{count} tokens in {seconds:.1f} s ({count / max(seconds, 1e-9):.1f} tokens/s)", file=sys.stderr)
    return 0


def chat_template(found: Loaded) -> Callable[[list[dict]], str]:
    """messages -> the text the model is given: the folder's chat template with its generation
    prompt, rendered as transformers' ``apply_chat_template`` renders it; one line without one."""
    tokenizer = found.tokenizer
    try:
        template, origin = read_chat_template(found.tokenizer_path, None)
    except ValueError as err:
        raise GenerateError(f"chat: {err}") from None
    if template is None:
        raise GenerateError(f"chat: the model's tokenizer ({found.tokenizer_path or 'the shipped one'}) has no chat "
                            f"template (no chat_template.jinja, no chat_template in tokenizer_config.json); use "
                            f"titan-lightning generate --prompt")
    try:
        compiled = compile_template(template, origin)
    except ValueError as err:
        raise GenerateError(f"chat: {err}") from None
    special = {k: v for k, v in (("bos_token", tokenizer.bos_token), ("eos_token", tokenizer.eot_token)) if v}

    def render(messages: list[dict]) -> str:
        try:
            return compiled.render(messages=messages, add_generation_prompt=True, **special)
        except Exception as err:  # noqa: BLE001 - a template is code from a downloaded folder: any error is its own
            message = " ".join(str(err).split())[:200] or type(err).__name__
            raise GenerateError(f"chat: the chat template ({origin}) fails: {message}") from None

    return render


def chat(loaded: Loaded, render: Callable[[list[dict]], str], sampling: Sampling,
         generator: Optional[torch.Generator] = None, *, system: Optional[str] = None,
         lines: Optional[Iterator[str]] = None) -> int:
    """The chat loop: a user line in, the assistant's reply streamed out, the conversation kept;
    until ``/exit`` or the end of ``lines`` (standard input)."""
    tokenizer = loaded.tokenizer
    messages = [{"role": "system", "content": system}] if system else []
    interactive = lines is None and sys.stdin.isatty()
    lines = lines if lines is not None else iter(sys.stdin)
    with Session(loaded.model) as session:
        while True:
            if interactive:
                print(">>> ", end="", file=sys.stderr, flush=True)
            line = next(lines, None)
            if line is None or line.strip() == EXIT:
                return 0
            if not line.strip():
                continue
            messages.append({"role": "user", "content": line.rstrip("\n")})
            ids = tokenizer.encode(render(messages))
            if len(ids) >= session.max_len:
                print(f"titan-lightning: chat: the conversation is {len(ids)} tokens, the model takes "
                      f"{session.max_len} (max_position_embeddings); start a new chat", file=sys.stderr, flush=True)
                return 1
            stream, reply = TextStream(tokenizer), []
            for token in generate_tokens(session, ids, sampling, generator):
                if token in sampling.eos_ids:
                    break
                reply.append(token)
                _print(stream.push(token))
            _print(stream.end() + "\n")
            messages.append({"role": "assistant", "content": tokenizer.decode(reply)})


def _print(text: str) -> None:
    sys.stdout.write(text)
    sys.stdout.flush()
