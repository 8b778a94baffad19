"""Settings of the model: `model` (source, dtype, LoRA / QLoRA) and the generated tiny model."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from tunix_pipeline.config.base import Strict


class TinyModelParams(Strict):
    """A Gemma-architecture model with random weights, built offline."""

    vocab_size: int = Field(512, ge=300)
    hidden_size: int = 64
    intermediate_size: int = 256
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 1
    head_dim: int = 16
    seed: int = 0


class LoraParams(Strict):
    """LoRA adapters through qwix; `quantize: nf4` makes it QLoRA (a frozen 4-bit base)."""

    rank: int = Field(16, gt=0)
    alpha: float = Field(32.0, gt=0)
    # regex over module paths, e.g. ".*attn.*|.*mlp.*"
    target_modules: str = ".*(q_einsum|kv_einsum|qkv_einsum|attn_vec_einsum|q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj).*"
    quantize: Literal["nf4"] | None = None


class ModelParams(Strict):
    # "tiny" (built locally from `tiny`), a local Hugging Face folder, a local .gguf file (or a folder holding
    # one), a hub id, or "kaggle:<handle>"
    source: str = "tiny"
    revision: str | None = None
    dtype: Literal["float32", "bfloat16"] = "float32"
    local_dir: str = Field("data/06_models/base_model", description="where `tiny` is built or a .gguf source converted")
    tiny: TinyModelParams = TinyModelParams()
    # null: full fine-tuning
    lora: LoraParams | None = None
