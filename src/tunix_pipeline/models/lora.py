"""LoRA and QLoRA adapters (through qwix), and merging them back into the weights."""

from __future__ import annotations

import contextlib

import jax
import numpy as np
import qwix
from flax import nnx

from tunix_pipeline.config import LoraParams
from tunix_pipeline.core.errors import ModelError
from tunix_pipeline.core.processes import host_array
from tunix_pipeline.models.loading import has_origin, load_model, origin_of, remember_origin


def apply_lora(model, lora: LoraParams, mesh: jax.sharding.Mesh | None = None, seed: int = 0):
    """`model` with LoRA adapters on the modules matching `lora.target_modules`.

    With `quantize: nf4` the frozen base weights are quantized to 4 bits (QLoRA).
    """
    provider = qwix.LoraProvider(
        module_path=lora.target_modules,
        rank=lora.rank,
        alpha=lora.alpha,
        weight_qtype=lora.quantize,
    )
    with mesh if mesh is not None else contextlib.nullcontext():
        adapted = qwix.apply_lora_to_model(model, provider, **model.get_model_input(), rngs=nnx.Rngs(seed))
    if not nnx.state(adapted, nnx.LoRAParam):
        raise ModelError(f"model.lora.target_modules {lora.target_modules!r} matches no module of this model")
    if adapted is not model and has_origin(model):
        remember_origin(adapted, *origin_of(model))
    return adapted


def load_run_model(folder, params, mesh: jax.sharding.Mesh | None, quantize: bool = True, remat: str = "none",
                   compute_dtype: str | None = None):
    """(model, Tunix config) as a run trains it: the base weights plus the configured adapters.

    `quantize=False` keeps a QLoRA run's base in full precision (to evaluate or export it);
    `compute_dtype`: `sft.compute_dtype` (`loading.run_config`).
    """
    model, cfg = load_model(folder, mesh, params.dtype, remat, compute_dtype)
    if params.lora is not None:
        lora = params.lora if quantize else params.lora.model_copy(update={"quantize": None})
        model = apply_lora(model, lora, mesh)
    return model, cfg


def parameter_counts(model) -> dict:
    """Trainable (LoRA when present, else every weight) and total parameter counts."""
    lora = sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.LoRAParam)))
    base = sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param))) - lora
    return {"trainable_params": int(lora or base), "total_params": int(base + lora)}


def _contracting_axes(module, weight_name: str) -> list[int]:
    """Axes of `weight` that qwix put into lora_a (the input side), in weight order."""
    einsum = getattr(module, "einsum_str", None)
    if einsum:
        lhs, rest = einsum.replace(" ", "").split(",")
        rhs = rest.split("->")[0]
        return [i for i, c in enumerate(rhs) if c in lhs]
    if isinstance(module, nnx.Linear) and weight_name == "kernel":
        return [0]
    raise ModelError(f"cannot merge LoRA into {type(module).__name__}.{weight_name}")


def merge_lora(model, alpha: float | None = None) -> dict[str, np.ndarray]:
    """Flat {"layers.0.attn.q_einsum.w": array} of the weights, each LoRA delta added (scaled alpha / rank, as qwix does).

    Multi-host: every process must call it (weights sharded over other processes are gathered).
    """
    params = {
        ".".join(map(str, path)): host_array(value[...])
        for path, value in nnx.to_flat_state(nnx.state(model, nnx.Param))
        if not isinstance(value, nnx.LoRAParam)
    }
    for path, module in nnx.iter_modules(model):
        for name in [n for n in vars(module) if n.endswith("_lora_a")]:
            if alpha is None:
                raise ModelError("the model has LoRA adapters: pass their alpha to merge them")
            weight_name = name[: -len("_lora_a")]
            key = ".".join(map(str, (*path, weight_name)))
            a = np.asarray(host_array(getattr(module, name)[...]), np.float32)
            b = np.asarray(host_array(getattr(module, weight_name + "_lora_b")[...]), np.float32)
            weight = params[key]
            axes = _contracting_axes(module, weight_name)
            letters = "abcdefghijklmnopq"[: weight.ndim]
            ca = "".join(letters[i] for i in axes)
            ra = "".join(c for i, c in enumerate(letters) if i not in axes)
            delta = np.einsum(f"{ca}z,z{ra}->{letters}", a, b) * (alpha / a.shape[-1])
            params[key] = (weight.astype(np.float32) + delta).astype(weight.dtype)
    return params
