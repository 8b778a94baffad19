"""A decode step's roofline: one home for the KV cache's bytes and the decode step's planned time, which GRPO's
generation (`planning.grpo`) and a judge's `read: number` scoring (`planning.judge`) both time."""

from __future__ import annotations

from tunix_pipeline.models.architecture import Architecture
from tunix_pipeline.planning.memory import NF4_BYTES, TrainSetup


def kv_cache_bytes(arch: Architecture, setup: TrainSetup, sequences: int, positions: int) -> float:
    """Per device: keys and values of `sequences` x `positions` in every layer (Tunix's cache: one size for all
    layers, sliding-window ones included), kv heads split over tp where they divide."""
    tp = setup.tp if arch.num_kv_heads % setup.tp == 0 else 1
    return arch.num_layers * 2 * sequences * positions * arch.num_kv_heads * arch.head_dim * setup.c_bytes / tp


def decode_step(arch: Architecture, hw, setup: TrainSetup, prompt: int, completion: int,
                compiled: dict | None = None) -> dict:
    """One decode step per device after a `prompt` with up to `completion` tokens to generate: its FLOPs and
    bytes (XLA:TPU's cost analysis of the compiled step, else the estimate's), its roofline (the larger of FLOPs /
    peak and bytes / HBM bandwidth) and the planned time, that roofline over the profile's
    `decode_roofline_fraction`; the times are None without both figures."""
    compiled = compiled or {}
    if compiled.get("flops_per_device") and compiled.get("bytes_accessed_per_device"):
        flops, read, source = compiled["flops_per_device"], compiled["bytes_accessed_per_device"], "XLA:TPU"
    else:
        seqs, tp = setup.per_device_batch, setup.tp
        flops = 2 * arch.params * seqs / tp
        weights_read = arch.params * (NF4_BYTES if setup.mode == "qlora" else setup.c_bytes) / tp
        # the cache is half full on average
        read = weights_read + kv_cache_bytes(arch, setup, seqs, prompt + completion // 2)
        source = "estimate"
    fraction = hw.decode_roofline_fraction
    roofline = bound = None
    if hw.hbm_gb_per_s:
        compute, memory = flops / (hw.peak_tflops * 1e12), read / (hw.hbm_gb_per_s * 1e9)
        roofline, bound = max(compute, memory), "compute" if compute > memory else "memory"
    return {
        "flops": flops, "bytes": read, "from": source, "bound": bound, "roofline_seconds": roofline,
        "roofline_fraction": fraction, "source": hw.decode_source,
        "seconds": roofline / fraction if roofline is not None and fraction else None,
    }


def decode_line(d: dict) -> str:
    """The decode step's roofline, where its figures come from, and the fraction of it the plan assumes."""
    where = "XLA:TPU's cost analysis of the compiled step" if d["from"] == "XLA:TPU" else "the estimate"
    text = (f"A decode step's roofline per device: {d['flops'] / 1e9:,.3g} GFLOP and {d['bytes'] / 1e9:,.3g} GB from "
            f"{where}")
    if d["roofline_seconds"] is None:
        return text + ": no time (the profile has no hbm_gb_per_s)."
    text += f", {d['roofline_seconds'] * 1e3:.3g} ms ({d['bound']}-bound)"
    if d["seconds"] is None:
        return text + "; no time: the profile has no decode_roofline_fraction."
    return (text + f"; planned {d['seconds'] * 1e3:.3g} ms at {d['roofline_fraction']:g} of it "
            f"({d['source'] or 'no decode_source'}).")
