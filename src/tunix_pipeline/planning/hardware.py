"""The hardware profile of the devices JAX sees (`plan.hardware: auto`)."""

from __future__ import annotations

import os

import jax
import psutil

from tunix_pipeline.config import HardwareProfile, PlanParams, RuntimeParams
from tunix_pipeline.planning.memory import GIB


def detect_profile(plan: PlanParams, runtime: RuntimeParams | None = None) -> tuple[str, HardwareProfile]:
    """The profile of the devices JAX sees (`plan.hardware: auto`)."""
    devices = jax.devices()
    kind = devices[0].platform
    n = len(devices)
    if kind == "cpu":
        base = plan.profiles.get("cpu") or HardwareProfile(kind="cpu", devices=n, memory_gib=1, peak_tflops=0.02)
        # the devices' programs share the host's memory with this process: what it holds now is not theirs
        total, held = _host_memory_bytes(), psutil.Process().memory_info().rss
        memory = (total - held) / n / GIB if total else base.memory_gib
        per_device_peak = base.peak_tflops * base.devices / n
        return "cpu", base.model_copy(update={"devices": n, "memory_gib": memory, "peak_tflops": per_device_peak,
                                              "process_gib": held / GIB if total else 0.0})
    device_kind = getattr(devices[0], "device_kind", kind)
    stats = devices[0].memory_stats() or {}
    match = _match(plan, kind, device_kind, n)
    if match is not None:
        name, hw = match
        update = {"devices": n}
        if stats.get("bytes_limit"):
            update["memory_gib"] = stats["bytes_limit"] / GIB
        return name, hw.model_copy(update=update)
    peak = (runtime.peak_flops_per_device / 1e12) if runtime and runtime.peak_flops_per_device else 100.0
    return f"detected {device_kind} x{n}", HardwareProfile(
        kind="tpu" if kind == "tpu" else "gpu",
        devices=n,
        memory_gib=(stats.get("bytes_limit") or 16 * GIB) / GIB,
        peak_tflops=peak,
        note=f"detected: {device_kind}",
    )


KIND_HINTS = {
    "v5 lite": "v5e", "v5e": "v5e", "v6 lite": "v6e", "v6e": "v6e", "v5p": "v5p", "v5": "v5p", "v4": "v4", "v3": "v3",
    "h200": "h200", "h100": "h100", "a100": "a100", "a10g": "a10g", "l4": "l4", "t4": "t4",
}


def _match(plan: PlanParams, kind: str, device_kind: str, n: int):
    low = device_kind.lower()
    hint = next((v for k, v in KIND_HINTS.items() if k in low), None)
    if hint is None:
        return None
    candidates = [(k, p) for k, p in plan.profiles.items() if hint in k and p.kind == ("tpu" if kind == "tpu" else "gpu")]
    exact = [(k, p) for k, p in candidates if p.devices == n and not k.startswith("kaggle")]
    return (exact or candidates or [None])[0]


def _host_memory_bytes() -> int | None:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None
