"""Settings of the `plan` preflight: hardware profiles, budgets, the XLA check."""

from __future__ import annotations

import math
import re
from typing import Literal

from pydantic import Field, model_validator

from tunix_pipeline.config.base import Strict


class HardwareProfile(Strict):
    """One machine to rent (or a free notebook session). Figures are per device, as JAX counts devices."""

    kind: Literal["cpu", "gpu", "tpu"]
    devices: int = Field(gt=0)
    hosts: int = Field(1, gt=0)
    memory_gib: float = Field(gt=0, description="memory per device")
    peak_tflops: float = Field(gt=0, description="dense bf16 TFLOP/s per device")
    cost_per_hour: float | None = Field(None, ge=0, description="USD/hour, whole machine, on demand")
    preemptible_cost_per_hour: float | None = Field(None, ge=0, description="USD/hour, spot/preemptible")
    session_hours: float | None = Field(None, gt=0, description="a session ends after this (Kaggle: 9)")
    weekly_hours: float | None = Field(None, gt=0, description="quota per week (Kaggle TPU: 20)")
    mfu: float | None = Field(None, gt=0, le=1, description="assumed MFU on this hardware; overrides plan.mfu")
    mfu_source: str = ""  # where the assumed MFU comes from (a published benchmark, a seed, a measurement)
    # a TPU's topology as libtpu names it (e.g. v5e:2x4, v4:4x4x2): the plan compiles the train step for it
    topology: str | None = None
    # decoding (GRPO's rollouts) reads every weight and the KV cache for each token: HBM bandwidth bounds it
    hbm_gb_per_s: float | None = Field(None, gt=0, description="memory bandwidth per device (GB/s)")
    hbm_source: str = ""  # the spec sheet it comes from
    # a GRPO decode step's time: its roofline (max of FLOPs / peak and bytes / hbm_gb_per_s, per device; XLA:TPU's
    # cost analysis of the compiled step, else the estimate's) over the share of it our sampler reaches
    decode_roofline_fraction: float | None = Field(
        None, gt=0, le=1, description="share of the decode step's roofline our sampler reaches; null: no decode time"
    )
    decode_source: str = ""  # what decode_roofline_fraction comes from: a measurement (what, where) or an assumption

    @model_validator(mode="before")
    @classmethod
    def _no_decode_utilisation(cls, data):
        return _renamed_decode_utilisation(data)

    @model_validator(mode="after")
    def _topology_has_the_devices(self):
        if self.topology is None:
            return self
        m = re.fullmatch(r"(v2|v3|v4|v5e|v5p|v6e|tpu7x):(\d+(?:x\d+){1,2})", self.topology)
        if self.kind != "tpu" or not m:
            raise ValueError(
                f"topology {self.topology!r}: a TPU profile's chip generation and chip grid as libtpu names them, "
                "e.g. v5e:2x4 (8 chips), v4:4x4x2 (32 chips), v5p:2x2x1, v6e:2x4"
            )
        chips = math.prod(int(x) for x in m.group(2).split("x"))
        per_chip = 2 if m.group(1) in ("v2", "v3", "tpu7x") else 1  # JAX's devices per chip (v4/v5p: megacore)
        if chips * per_chip != self.devices:
            raise ValueError(f"topology {self.topology} has {chips * per_chip} JAX devices, the profile says devices: {self.devices}")
        return self
    setup_minutes: float | None = Field(None, ge=0, description="overrides plan.session_setup_minutes")
    # the volumes a run's outputs go on (planning/disk.py): the machine's disk for one session, and what of the
    # output root outlives it (Kaggle saves 20 GB of /kaggle/working; the next session starts from that); null:
    # not known / no limit (a Cloud TPU VM keeps its disk; a gs:// output root has no limit)
    disk_gb: float | None = Field(None, gt=0, description="the session's disk (GB)")
    saved_output_gb: float | None = Field(None, gt=0, description="what of the output root a session saves (GB)")
    disk_source: str = ""  # where the volume figures come from
    note: str = ""
    # the CPU a run plans on (`plan.hardware: auto`): host memory the planning process already holds (the runtime,
    # the libraries, the data), which its programs share; memory_gib is what is left of the host for them
    process_gib: float = Field(0.0, ge=0)
    # another estimate of SFT on this machine (a seed's), printed beside the plan's examples per session; it sizes nothing
    quoted_estimate: str = ""
    # another figure for GRPO on this machine (a seed's), printed beside the plan's completions an hour; it sizes nothing
    quoted_grpo_estimate: str = ""


def _renamed_decode_utilisation(data):
    """The old key, a share of HBM bandwidth, as one clear error naming its replacement."""
    if isinstance(data, dict) and "decode_utilisation" in data:
        raise ValueError(
            "decode_utilisation (a share of HBM bandwidth) is replaced by a profile's decode_roofline_fraction: the "
            "share of the decode step's roofline (XLA:TPU's cost analysis or the estimate) the sampler reaches, "
            "with decode_source saying what it was measured on or assumed from (docs/plan.md)"
        )
    return data


class PlanBudget(Strict):
    max_cost: float | None = Field(None, ge=0, description="USD for the whole run")
    max_hours: float | None = Field(None, gt=0, description="wall-clock hours for the whole run")
    preemptible: bool = False  # price at the preemptible rate where a profile has one


class XlaCheckParams(Strict):
    """Compile the train step ahead of time (abstract shapes, no weights): for the TPU topology of the
    selected profile when libtpu is installed, else on a fake CPU mesh."""

    enabled: bool = True
    # deeper models are compiled at one and two layer periods (XLA:TPU: two and four layers, or two and three
    # periods) and extrapolated; null: every layer
    max_layers: int | None = Field(4, gt=0)
    timeout_seconds: int = Field(900, gt=0)
    grpo: bool = True  # also compile GRPO's decode step and policy update (XLA:TPU, or this CPU's XLA) when GRPO is planned


class PlanParams(Strict):
    enabled: bool = True  # the sft pipeline runs the plan first and stops a run that cannot fit
    hardware: str = "auto"  # a profile name, or auto: the devices JAX sees
    mfu: float = Field(0.47, gt=0, le=1, description="assumed model FLOP utilisation")
    # decoding (pair building, GRPO rollouts) reads every weight per token of a batch: far below training's MFU
    generation_mfu: float = Field(0.05, gt=0, le=1, description="assumed FLOP utilisation while generating")
    checkpoint_seconds: float | None = Field(None, ge=0, description="null: checkpoint bytes / checkpoint_gb_per_s")
    checkpoint_gb_per_s: float = Field(0.5, gt=0)
    session_setup_minutes: float = Field(30.0, ge=0, description="per session: install, load, compile")
    usable_memory_fraction: float = Field(0.95, gt=0, le=1)
    warn_memory_fraction: float = Field(0.9, gt=0, le=1)
    # under this share of real tokens in a row (the tokenize report), without packing, the plan says what packing saves
    warn_padding_efficiency: float = Field(0.6, gt=0, le=1)
    # under this share of the trained elements a step at the peak learning rate can change in their dtype (bf16
    # rounds most of a small update away), the plan warns with the fix (`planning.precision`)
    warn_update_share: float = Field(0.5, gt=0, le=1)
    large_model_params: float = Field(1.0e9, gt=0, description="seed 004: warn for models this big on small GPUs")
    small_gpu_gib: float = Field(24.0, gt=0)
    train_rows: int | None = Field(None, gt=0, description="to report epochs when the data is not at hand")
    # the examples packed into those rows (tokenize.pack), for examples per hour when the data is not at hand
    train_examples: int | None = Field(None, gt=0)
    budget: PlanBudget = PlanBudget()
    xla_check: XlaCheckParams = XlaCheckParams()
    profiles: dict[str, HardwareProfile] = Field(min_length=1)
    # hub id -> its config.json, for models not downloaded yet
    architectures: dict[str, dict]  # no default: conf/base holds the table

    @model_validator(mode="before")
    @classmethod
    def _no_decode_utilisation(cls, data):
        return _renamed_decode_utilisation(data)

    @model_validator(mode="after")
    def _known_hardware(self):
        if self.hardware != "auto" and self.hardware not in self.profiles:
            raise ValueError(f"plan.hardware {self.hardware!r} is not a profile; choose auto or one of {sorted(self.profiles)}")
        return self
