"""Recipes: every job of the seeds as a Kedro environment under conf/.

Each one loads and validates, overrides only what differs from conf/base, says what its
seed says (model, hardware, batch, length, checkpoints), and is planned here by
`kedro run --pipelines=plan --env <recipe>` (abstract shapes, no weights) with figures that
agree with the seed's own where it gives one, or differ for the reason its file states.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from kedro.framework.session import KedroSession
from kedro.framework.startup import bootstrap_project

from tunix_pipeline.config import RuntimeParams, SftParams, TrackingParams
from tunix_pipeline.planning import PlanError, build_plan, compiled_figures, estimate_memory, resolve
from tunix_pipeline.planning.memory import GIB

from .conftest import ROOT, copy_project

RECIPES = ["tpu_full", "qwen05b_v5e8", "gpu24_lora", "gpu80_lora_7b", "v4_64_pod", "kaggle_gemma3_1b_v5e8",
           "kaggle_gemma2_2b_v5e8", "kaggle_gemma3_1b_judge_v5e8"]
KAGGLE = ["kaggle_gemma3_1b_v5e8", "kaggle_gemma2_2b_v5e8"]
# the TPU recipes' plans compile their train step for their topology (XLA:TPU through libtpu, on
# this CPU; 1 and 2 layers for the deep models) and rest on it; the GPU and Kaggle recipes skip the
# check here (each TPU compile is minutes of this CPU)
TPU_RECIPES = {"tpu_full": "v5e:2x4", "qwen05b_v5e8": "v5e:2x4", "v4_64_pod": "v4:4x4x2"}
# the pod's mesh names all 32 of its devices: it is planned by the CLI in a process that has them
SUBPROCESS = {"v4_64_pod"}
KEDRO = str(Path(sys.executable).parent / "kedro")
GB = 1e9
TPU_FULL_RESTATES = {"sft.optimizer", "sft.schedule", "grpo.batch_size", "grpo.num_generations"}


def _session(path, env, **runtime_params):
    bootstrap_project(path)
    return KedroSession.create(project_path=path, env=env, runtime_params=runtime_params or None)


def _recipe_file(env) -> dict:
    return yaml.safe_load((ROOT / "conf" / env / "parameters.yml").read_text())


def _base() -> dict:
    out = {}
    for path in sorted((ROOT / "conf" / "base").glob("parameters*.yml")):
        out.update(yaml.safe_load(path.read_text()) or {})
    return out


def _leaves(tree, prefix=()):
    for key, value in tree.items():
        if isinstance(value, dict) and value:
            yield from _leaves(value, prefix + (key,))
        else:
            yield prefix + (key,), value


def _lookup(tree, path):
    for key in path:
        if not isinstance(tree, dict) or key not in tree:
            return KeyError
        tree = tree[key]
    return tree


@pytest.fixture(scope="module")
def recipes_project(tmp_path_factory):
    path = copy_project(tmp_path_factory.mktemp("recipes") / "project")
    cwd = os.getcwd()
    os.chdir(path)
    yield path
    os.chdir(cwd)


@pytest.fixture(scope="module")
def params(recipes_project):
    """Every recipe's parameters as the nodes get them: merged with base, validated by Kedro."""
    out = {}
    for env in RECIPES:
        with _session(recipes_project, env) as session:
            out[env] = session.load_context().params
    return out


class _Plans(dict):
    """plan.json and plan.md of `kedro run --pipelines=plan --env <recipe>`, each recipe planned when a test first
    reads it: a test waits for the plans it checks only (the TPU recipes' compiles are minutes each)."""

    def __init__(self, project: Path):
        super().__init__()
        self.project, self.failed = project, {}

    def __missing__(self, env):
        if env in self.failed:  # planned once: a failed plan fails each test that reads it, not planned again
            raise self.failed[env]
        try:
            self[env] = self._run(env)
        except Exception as err:
            self.failed[env] = err
            raise
        return self[env]

    def _run(self, env):
        reports = self.project / "data" / "08_reporting"
        xla_off = {"xla_check": {"enabled": False}}
        sft_only = {"xla_check": {"grpo": False}}  # the SFT step's compile is tested here; GRPO's in test_planning_grpo
        if env in SUBPROCESS:
            env_vars = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}  # the recipe's own device count
            done = subprocess.run(
                [KEDRO, "run", "--pipelines=plan", "--env", env],
                cwd=self.project, capture_output=True, text=True, env=env_vars, timeout=1200,
            )
            assert done.returncode == 0, done.stderr[-3000:]
        else:
            with _session(self.project, env, plan=sft_only if env in TPU_RECIPES else xla_off) as session:
                session.run(pipeline_names=["plan"])
        return json.loads((reports / "plan.json").read_text()), (reports / "plan.md").read_text()


@pytest.fixture(scope="module")
def plans(recipes_project):
    return _Plans(recipes_project)


def _plan(params, env, **sft_changes):
    """The recipe's plan object, built directly (for what-ifs beside the pipeline's figures)."""
    p = params[env]
    sft = p["sft"].model_copy(update=sft_changes)
    return build_plan(p["model"], sft, p["runtime"], p["tokenize"], p["plan"])


# ---------------------------------------------------------------- configuration
@pytest.mark.parametrize("env", RECIPES)
def test_every_recipe_validates_and_overrides_only_what_differs(params, env):
    p = params[env]
    assert {"model", "sft", "runtime", "tokenize", "plan", "ingest"} <= set(p)
    # planned on a named hardware profile (not `auto`: this machine is not the target)
    assert p["plan"].hardware in p["plan"].profiles
    base, recipe = _base(), _recipe_file(env)
    assert set(recipe) <= set(base), f"{env}: sections unknown to conf/base: {set(recipe) - set(base)}"
    same = [".".join(path) for path, value in _leaves(recipe) if _lookup(base, path) == value]
    # tpu_full (older than the rule, kept as it is) spells out its seed's optimizer and checkpoint settings
    allowed = TPU_FULL_RESTATES if env == "tpu_full" else set()
    assert set(same) <= allowed, f"conf/{env} repeats conf/base for {sorted(set(same) - allowed)}"


def test_tpu_full_is_seed_000_and_004(params):
    p = params["tpu_full"]
    assert p["model"].source == "google/gemma-2b" and p["model"].lora is None
    # float32 masters, bf16 compute and first moment, shipped in bf16
    assert (p["model"].dtype, p["sft"].compute_dtype, p["sft"].mu_dtype) == ("float32", "bfloat16", "bfloat16")
    assert p["export"].dtype == "bfloat16" and p["sessions"]["plan"][2]["params"]["model"] == {"dtype": "bfloat16"}
    assert p["plan"].hardware == "kaggle-tpu-v5e-8" and p["runtime"].mesh == "auto"
    assert p["tokenize"].max_length == 1024 and p["sft"].per_device_batch_size == 4
    assert p["sft"].optimizer == "adamw" and p["sft"].warmup_steps > 0
    # packed GSM8K, 3 epochs, a checkpoint every third of the run (tests/test_recipes_data.py measures the rows)
    assert p["tokenize"].pack and (p["sft"].max_steps, p["sft"].epochs) == (None, 3)
    # one checkpoint of 25 GB on the session's scratch disk: two with the one being written pass its 73 GB
    assert (p["sft"].checkpoint_every, p["sft"].keep_checkpoints, p["sft"].time_budget_hours) == (40, 1, 9)
    assert p["sft"].checkpoint_dir.startswith("/kaggle/temp/")
    assert not p["grpo"].enabled


def test_qwen05b_v5e8_is_seed_001(params):
    p = params["qwen05b_v5e8"]
    assert p["model"].source == "Qwen/Qwen2.5-0.5B" and p["model"].lora is None
    assert p["sft"].compute_dtype == "bfloat16"  # bf16 compute on float32 master weights
    assert p["plan"].hardware == "tpu-v5e-8" and p["plan"].profiles["tpu-v5e-8"].devices == 8
    sft = p["sft"]
    assert (sft.per_device_batch_size, sft.gradient_accumulation_steps, sft.epochs, sft.max_steps) == (4, 2, 3, None)
    assert sft.per_device_batch_size * 8 * sft.gradient_accumulation_steps == 64
    assert p["tokenize"].max_length == 1000
    assert (sft.checkpoint_every, sft.keep_checkpoints) == (50, 2)
    (source,) = p["ingest"].sources
    assert source.format == "prompt_response" and source.hf.path == "rzeraat/law"
    # W&B is left to a comment in the recipe: the option it names must exist
    assert "tracking.wandb" in (ROOT / "conf" / "qwen05b_v5e8" / "parameters.yml").read_text()
    assert "wandb" in TrackingParams.model_fields and not p["tracking"].wandb.enabled


@pytest.mark.parametrize("env, low, high, min_gib, max_gib", [
    ("gpu24_lora", 1e9, 3e9, 20, 24),
    ("gpu80_lora_7b", 6.5e9, 8e9, 78, 82),
])
def test_the_lora_recipes_are_seed_002(params, env, low, high, min_gib, max_gib):
    p = params[env]
    assert (p["model"].lora.rank, p["model"].lora.alpha, p["model"].lora.quantize) == (16, 32.0, None)
    assert low < resolve(p["model"], p["plan"].architectures).params < high
    hw = p["plan"].profiles[p["plan"].hardware]
    assert hw.kind == "gpu" and hw.devices == 1 and min_gib <= hw.memory_gib <= max_gib
    assert p["runtime"].mesh == "auto" and p["runtime"].host_device_count == 1


def test_v4_64_pod_is_seed_003(params):
    p = params["v4_64_pod"]
    hw = p["plan"].profiles[p["plan"].hardware]
    assert p["plan"].hardware == "tpu-v4-64" and (hw.devices, hw.hosts) == (32, 8)  # 64 cores = 32 JAX devices
    # data parallel over the whole slice, every device named (a lone worker must not train by itself)
    assert p["runtime"].mesh == {"data": 1, "fsdp": 32, "tp": 1}
    assert p["sft"].per_device_batch_size * 32 == 6144 and p["sft"].gradient_accumulation_steps == 1
    assert p["sft"].per_device_batch_size * hw.devices // hw.hosts == 768  # the seed's per-worker batch
    assert p["sft"].checkpoint_every == 1000 and p["tokenize"].max_length == 97
    assert 6.5e6 < resolve(p["model"], p["plan"].architectures).params < 7.5e6  # seed 003: ~7M
    # the plan runs anywhere; the launch command adds runtime.distributed=auto
    assert p["runtime"].distributed == "off"
    assert "runtime.distributed=auto" in (ROOT / "README.md").read_text()


# ---------------------------------------------------------------- the plan of every recipe vs its seed
@pytest.mark.slow  # the plans compile with XLA:TPU
@pytest.mark.parametrize("env", RECIPES)
def test_every_recipe_plans_offline(plans, params, env):
    summary, report = plans[env]
    assert summary["hardware"] == params[env]["plan"].hardware
    assert summary["status"] in ("ok", "risky") and summary["profiles"][summary["hardware"]]["fits"]
    assert summary["memory_per_device_gib"] > 0 and summary["step_seconds"] > 0 and summary["hours"] > 0
    assert summary["cost"] is not None and "## Every hardware profile" in report


@pytest.mark.slow  # the plans compile with XLA:TPU
def test_qwen05b_v5e8_against_seed_001(plans, params):
    summary, report = plans["qwen05b_v5e8"]
    m = summary["memory"]
    assert summary["status"] == "ok" and summary["global_batch"] == 64
    # 3 epochs: 1,951 rows are 60 micro-batches of 32 a epoch, 2 per optimizer step
    assert summary["steps"] == 90 and "3.0 epochs" in report
    # seed 001: ~1.7 GB per core, "well within 16 GB"; it counts the bf16 weights (1 GB) and the layer
    # inputs (~0.7 GB). The plan's weights (sharded 8 ways, fp32 masters, bf16 copy) and kept activations
    # (the bf16 layer inputs and each layer's gathered weights, which XLA keeps for the backward) come
    # to about as much, and the copies XLA:TPU makes of each layer's states (896 / 8 off its 128-lane tile)
    # as much again; it adds the AdamW state and the output layer, a chunk of 151,936-word logits at a time
    assert summary["memory_fraction"] < 0.3  # XLA:TPU: ~4.3 GiB per 16 GiB chip (7.5 with the whole logits)
    assert 0.9 < (m["params_gib"] + m["activations_gib"]) * GIB / (1.7 * GB) < 1.5
    assert m["logits_gib"] < 1.3 and summary["memory_per_device_gib"] > 1.7 * GB / GIB
    # seed 001: ~30 min for 3 epochs, $0.60 preemptible, $2.40 on demand, ~0.1 s a batch of 32
    assert 0.4 < summary["hours"] < 0.75
    assert abs(summary["cost"] / 2.40 - 1) < 0.25 and abs(summary["preemptible_cost"] / 0.60 - 1) < 0.25
    assert 0.05 < summary["step_seconds"] / summary["gradient_accumulation"] < 0.25
    assert summary["xla_check"]["mesh"] == {"data": 1, "fsdp": 8, "tp": 1}
    assert summary["xla_check"]["method"].startswith("compiled all 24 layers")  # every layer (maybe read back)


@pytest.mark.slow  # the plans compile with XLA:TPU
@pytest.mark.parametrize("env", sorted(TPU_RECIPES))
def test_the_tpu_recipes_compile_for_their_topology_and_fit(plans, env):
    # XLA:TPU compiles the recipe's own step (bf16, remat, loss chunks, accumulation, its mesh) for its
    # chips; the plan's memory and FLOPs are the compiled program's, and the estimate is within 10% of it
    summary, report = plans[env]
    xla = summary["xla_check"]
    assert "error" not in xla, xla
    assert xla["platform"] == "tpu" and xla["topology"] == TPU_RECIPES[env]
    assert summary["memory_from"] == summary["flops_from"] == "XLA:TPU"
    assert summary["memory_per_device_gib"] == round(xla["xla_gib"], 3) and summary["memory_fraction"] < 1
    assert f"compiled by XLA:TPU for {TPU_RECIPES[env]}" in report and "is **assumed**" in report
    print(f"{env}: XLA:TPU {xla['xla_gib']:.2f} GiB per chip, estimate {xla['difference']:+.1%} ({xla['method']})")
    assert abs(xla["difference"]) < 0.10, xla
    # under the compilers the figures were shipped for, the recipe's programs are the shipped ones: a change to what
    # they compile ships their figures again (another JAX or libtpu compiles them, as a changed recipe does)
    if compiled_figures.shipped()["versions"] == compiled_figures.versions():
        assert "read back" in xla["method"], (
            f"{env}'s XLA:TPU programs are not the shipped ones: `python -m tunix_pipeline.planning.compiled_figures`")


@pytest.mark.slow  # the plans compile with XLA:TPU
def test_v4_64_pod_against_seed_003(plans):
    summary, _ = plans["v4_64_pod"]
    assert summary["status"] == "ok" and summary["global_batch"] == 6144
    assert summary["mesh"] == {"data": 1, "fsdp": 32, "tp": 1} and summary["per_device_batch"] == 192
    # seed 003: "~3 GB per worker" (4 devices, JAX's chips); XLA:TPU compiles the step to ~1 GiB per chip,
    # ~4.2 GB per worker: the seed's own figure is a rough one, and low
    assert 1.0 < 4 * summary["memory_per_device_gib"] * GIB / (3 * GB) < 1.6
    # seed 003: ~17 ms a step, ~360,000 examples/s over the slice (the profile's mfu is calibrated to it)
    assert abs(summary["step_seconds"] / 0.017 - 1) < 0.25
    assert abs(summary["samples_per_hour"] / 3600 / 360_000 - 1) < 0.25


@pytest.mark.slow  # the plans compile with XLA:TPU
def test_gpu24_lora_against_seed_002(plans, params):
    summary, _ = plans["gpu24_lora"]
    hw = params["gpu24_lora"]["plan"].profiles["a10g-small"]
    # fits even JAX's default share of GPU memory (75%), no XLA_PYTHON_CLIENT_MEM_FRACTION needed
    assert summary["memory_per_device_gib"] < 0.75 * hw.memory_gib
    # a 1.5B model on a 24 GB card: seed 004's guardrail warns, and only it
    assert summary["status"] == "risky" and len(summary["warnings"]) == 1
    assert "large model on a small GPU" in summary["warnings"][0]
    # seed 002: LoRA needs ~4 GB per billion parameters (~6 GB); with gradient checkpointing on the plan says
    # ~2.6 since the loss holds one chunk of logits, not all of them; without it (the recipe: faster) it adds the
    # activations of 4 x 512 tokens
    plan = _plan(params, "gpu24_lora")
    remat = estimate_memory(plan.job.arch, plan.selected.setup.replace(remat="decoder")).peak
    rule = 4 * plan.job.arch.params / 1e9 * GB
    assert 0.5 < remat / rule < 0.8
    assert summary["memory"]["activations_gib"] * GIB > 0.5 * rule


@pytest.mark.slow  # the plans compile with XLA:TPU
def test_gpu80_lora_7b_against_seed_002(plans):
    summary, _ = plans["gpu80_lora_7b"]
    assert summary["status"] == "ok" and summary["memory_per_device_gib"] < 0.75 * 80
    # seed 002: "Qwen2.5-7B LoRA: ~28 GB"; the plan adds the bf16 activations of 4 x 512 tokens without
    # remat (~14 GiB) and the float32 logits of the 152k-word vocabulary: ~32 GiB
    assert 1.0 < summary["memory_per_device_gib"] * GIB / (28 * GB) < 1.4


@pytest.mark.slow  # the plans compile with XLA:TPU
def test_tpu_full_against_seed_000(plans):
    summary, _ = plans["tpu_full"]
    # seed 000's session 1: SFT within one 9 h Kaggle session (now 3 packed epochs, not the seed's 13)
    assert summary["sessions"] == 1 and summary["steps_per_session"] >= summary["steps"] == 114  # 3 epochs, packed
    assert summary["memory_fraction"] < 1 and summary["global_batch"] == 32
    # float32 masters: a step at 2e-5 and at the cosine's end can change every weight (bf16 weights: ~19% and ~1%)
    assert summary["update_precision"]["share_changed"]["end"] > 0.99
    assert not any("updates round away" in w for w in summary["warnings"])
    # GRPO's session loads the model in bf16: its reference is a bf16 copy (0.58 GiB a chip; float32: 1.17)
    assert summary["grpo"]["selected"]["reference_gib"] == pytest.approx(0.584, abs=0.005)


@pytest.mark.slow  # the plans compile with XLA:TPU
@pytest.mark.parametrize("env", KAGGLE)
def test_kaggle_recipe_chains_lora_sft_simpo_grpo_within_the_session_and_week(plans, params, env):
    """The hackathon's recipe: LoRA SFT, then SimPO, then GRPO, one Kaggle TPU v5e-8 session each."""
    p, (summary, report) = params[env], plans[env]
    hw = p["plan"].profiles[p["plan"].hardware]
    sessions = p["sessions"]["plan"]
    assert [s["name"] for s in sessions] == ["sft_lora", "simpo", "grpo"]
    assert all(s["hours"] <= hw.session_hours for s in sessions)  # 9 h a session
    assert sum(s["hours"] for s in sessions) <= min(p["sessions"]["weekly_hours"], hw.weekly_hours)  # 20 h a week
    # session 1 (the parameters the nodes get now): LoRA SFT only
    assert p["model"].lora is not None and not p["preference"].enabled and not p["grpo"].enabled
    assert sessions[1]["params"] == {"sft": {"max_steps": 0}, "preference": {"enabled": True}}
    assert sessions[2]["params"] == {"sft": {"max_steps": 0}, "grpo": {"enabled": True}}
    assert p["preference"].method == "simpo" and p["preference"].pairs == "from_rewards"
    # SFT fits a 16 GiB chip and its session, set-up included
    assert summary["memory_per_device_gib"] <= hw.memory_gib * p["plan"].usable_memory_fraction
    assert summary["sessions"] == 1 and summary["hours"] <= sessions[0]["hours"]
    # SimPO (planned from session 2's parameters): no reference model, fits, pair building and training in time
    pref = summary["preference"]["selected"]
    assert summary["preference"]["method"] == "simpo" and summary["preference"]["reference"] == "none"
    assert pref["fits"] and pref["reference_gib"] == 0 and pref["pair_building_samples"] > 0
    assert pref["session_hours"] == sessions[1]["hours"]
    assert pref["hours"] + p["plan"].session_setup_minutes / 60 <= sessions[1]["hours"] and pref["within_session"]
    assert "## Preference stage (simpo, pairs from rewards, reference none)" in report
    # GRPO (session 3's parameters): generation and update each fit a 16 GiB chip, the steps its 9 h
    g = summary["grpo"]["selected"]
    usable = hw.memory_gib * p["plan"].usable_memory_fraction
    assert g["generation_gib"] <= usable and g["update_gib"] <= usable and g["fits"]
    assert g["session_hours"] == sessions[2]["hours"] and g["hours"] <= sessions[2]["hours"] and g["within_session"]
    assert summary["grpo"]["reference"] == "adapters" and 0 < g["reference_gib"] < 0.1  # LoRA: the base is shared
    completions = summary["grpo"]["completions_per_step"]
    assert completions == 128 and g["sequences_per_device"] == 16 and g["micro_batches"] == 8
    assert f"## GRPO (grpo, {completions} completions a step, reference adapters)" in report
    assert "| generation (KV cache" in report
    # the decode step: its roofline (the estimate's here; XLA:TPU's in a plan run with libtpu) over the TPUs'
    # fraction, not seed 000's observed GRPO rate, which the report prints beside the plan's for comparison
    assert g["decode_step"]["roofline_fraction"] == hw.decode_roofline_fraction and "seed" not in hw.decode_source
    assert g["quoted_estimate"] and "150-200 GRPO completions an hour" in g["quoted_estimate"]
    assert f"**GRPO completions an hour on kaggle-tpu-v5e-8:** this plan {g['samples_per_hour']:,.0f}" in report
    assert "seed 000 observed ~150-200 GRPO completions an hour" in report
    update_only = completions * 3600 / g["update_seconds"]
    if env == "kaggle_gemma3_1b_v5e8":
        assert g["samples_per_hour"] >= 20_000
    else:  # Gemma-2-2B: decoding alone would; the update at the recipe's MFU (0.035, seed 000's SFT rate) does not
        assert completions * 3600 / g["generation_seconds"] >= 20_000 > update_only and g["samples_per_hour"] >= 10_000
    stages = summary["stages"]
    assert set(stages["hours"]) == {"sft", "preference", "grpo"} and stages["total_hours"] <= p["sessions"]["weekly_hours"]
    print(f"{env}: GRPO generation {g['generation_gib']:.2f} GiB, update {g['update_gib']:.2f} GiB per chip, "
          f"{g['samples_per_hour']:.0f} completions/h, {g['hours']:.1f} h; every stage {stages['total_hours']:.1f} h")


@pytest.mark.slow  # the plans compile with XLA:TPU
def test_the_judge_recipe_is_the_gemma3_recipe_with_a_gemma3_4b_judge_on_half_the_chips(plans, params):
    """The winners' layout: Gemma-3-1B's chain, GRPO also rewarded by gemma-3-4b-it on 4 of the v5e-8's chips."""
    p, base = params["kaggle_gemma3_1b_judge_v5e8"], params["kaggle_gemma3_1b_v5e8"]
    for section in ("model", "sft", "tokenize", "runtime", "ingest", "evaluate", "sessions"):
        assert p[section] == base[section], section
    (judge,) = [r.judge for r in p["grpo"].rewards if r.fn == "judge"]
    assert (judge.source, judge.dtype, judge.read, judge.devices) == ("google/gemma-3-4b-it", "bfloat16", "label", 4)
    assert {r.fn for r in p["grpo"].rewards} == {"format_exact", "format_approx", "answer", "judge"}
    assert "judge" not in {r.fn for r in p["preference"].from_rewards.rewards}  # pair building as the 1B recipe's
    summary, report = plans["kaggle_gemma3_1b_judge_v5e8"]
    g = summary["grpo"]["selected"]
    j = g["judge"]
    (d,) = j["judges"]
    assert (j["sub_mesh_devices"], j["policy_devices"]) == (4, 4) and g["fits"] and j["problem"] is None
    assert 3.5e9 < d["architecture"]["params"] < 4.5e9 and d["calls"] == 128 // 16
    # the 4B's bf16 weights over its 4 chips, and one call of 4 rubrics a chip, within a chip
    assert d["weights_gib"] == pytest.approx(d["architecture"]["params"] * 2 / 4 / GIB, rel=0.01)
    assert d["weights_gib"] < j["sub_mesh_gib"] < g["usable_memory_gib"]
    # the policy decodes the 128 completions on its 4 chips; the judge's time is in the step, within the session
    assert g["sequences_per_device"] == 32 and g["step_seconds"] > g["update_seconds"] + j["seconds"]
    assert g["within_session"] and g["hours"] <= p["sessions"]["plan"][2]["hours"]
    assert "judge `judge`: google/gemma-3-4b-it" in report and "the policy runs on the other 4 devices" in report
    print(f"judge recipe: judge {j['sub_mesh_gib']:.2f} GiB per chip, {j['seconds']:.1f} s a step; GRPO "
          f"{g['step_seconds']:.1f} s a step, {g['samples_per_hour']:.0f} completions/h, {g['hours']:.2f} h")


# ---------------------------------------------------------------- disk
@pytest.mark.parametrize("env", ["tpu_full", *KAGGLE, "kaggle_gemma3_1b_judge_v5e8"])
def test_every_session_of_the_kaggle_recipes_fits_the_saved_output(params, env):
    """Each session's outputs under /kaggle/working within the 20 GB a notebook saves, the session disk's peak
    within its 73 GB (planning/disk.py, the figures of each recipe's comment and docs/plan.md's Disk section)."""
    from tunix_pipeline.planning.disk import GB as DISK_GB
    from tunix_pipeline.planning.disk import disk_sessions, plan_disk
    from tunix_pipeline.stages import STAGES

    p = params[env]
    plan = _plan(params, env)
    hw = plan.selected.hw
    disk = plan_disk(plan.job.arch, plan.selected.setup, hw,
                     disk_sessions(p["model"], {s.name: p[s.name] for s in STAGES}, p["sessions"], plan.job.max_steps),
                     p["export"], p["tracking"], p["runtime"].output_root)  # /kaggle/working on Kaggle
    assert (hw.saved_output_gb, hw.disk_gb) == (20, 73) and disk["volumes"]["fresh_root_each_session"]
    assert disk["status"] == "ok", disk["messages"]
    sessions = {s["name"]: s for s in disk["sessions"]}
    assert list(sessions) == [s["name"] for s in p["sessions"]["plan"]]
    saved = max(s["totals"]["saved"] for s in disk["sessions"]) / DISK_GB
    peak = max(s["totals"]["disk_peak"] for s in disk["sessions"]) / DISK_GB
    if env == "tpu_full":  # full checkpoints of 25 GB on scratch; the 10 GB float32 final weights and bf16 export saved
        outputs = {o["what"]: o for o in sessions["sft_gsm8k"]["outputs"]}
        assert outputs["sft checkpoints"]["where"] == "scratch" and outputs["sft checkpoints"]["count"] == 1
        assert outputs["sft checkpoints"]["gb_each"] == pytest.approx(25.06, abs=0.01)
        assert outputs["sft final weights (for the next session)"]["gb"] == pytest.approx(10.03, abs=0.01)
        assert saved == pytest.approx(15.1, abs=0.1) and peak == pytest.approx(70.2, abs=0.1)
    elif env == "kaggle_gemma2_2b_v5e8":
        assert saved == pytest.approx(11.3, abs=0.1) and peak == pytest.approx(16.7, abs=0.1)
    else:
        assert saved == pytest.approx(4.5, abs=0.1) and peak == pytest.approx(6.7, abs=0.1)


# ---------------------------------------------------------------- knobs the recipes needed
def test_epochs_become_optimizer_steps():
    sft = SftParams(max_steps=None, epochs=3, per_device_batch_size=4, gradient_accumulation_steps=2,
                    learning_rate=1e-5, warmup_steps=10, checkpoint_every=50)
    # 1,951 rows: 60 full micro-batches of 32 an epoch (the rest is dropped), 2 per optimizer step
    assert sft.steps_for(1951, 32).max_steps == 90
    assert sft.model_copy(update={"epochs": 0.5}).steps_for(1951, 32).max_steps == 15
    fixed = SftParams(max_steps=7, per_device_batch_size=4, learning_rate=1e-5, checkpoint_every=5)
    assert fixed.steps_for(1951, 32) is fixed


def test_a_misconfigured_recipe_fails_with_a_clear_message(params):
    base = {"per_device_batch_size": 4, "learning_rate": 1e-5, "checkpoint_every": 50}
    with pytest.raises(ValueError, match="set exactly one of sft.max_steps and sft.epochs .*max_steps: null"):
        SftParams(max_steps=200, epochs=3, **base)  # a recipe that sets epochs but inherits base's max_steps
    with pytest.raises(ValueError, match="set sft.max_steps, or sft.epochs"):
        SftParams(max_steps=None, **base)
    sft = SftParams(max_steps=None, epochs=1, warmup_steps=100, **base)
    with pytest.raises(ValueError, match=r"1 epochs of 1951 rows are 60 optimizer steps, not more than warmup_steps \(100\)"):
        sft.steps_for(1951, 32)
    with pytest.raises(ValueError, match="10 training rows cannot fill one micro-batch of 32"):
        sft.steps_for(10, 32)
    # planning by epochs without the data needs plan.train_rows
    p = params["qwen05b_v5e8"]
    with pytest.raises(PlanError, match="needs the number of training rows to plan the steps: set plan.train_rows"):
        build_plan(p["model"], p["sft"], p["runtime"], p["tokenize"], p["plan"].model_copy(update={"train_rows": None}))
    # the pod recipe started on one worker without runtime.distributed=auto: it sees its own chips only
    from tunix_pipeline.core.runtime import MeshError, make_mesh

    with pytest.raises(MeshError, match=r"needs 32 devices but JAX sees 8.*runtime\.distributed=auto"):
        make_mesh(params["v4_64_pod"]["runtime"])


def test_training_by_epochs_runs_those_steps_and_ends_at_a_barrier(tiny_model_dir, tmp_path, monkeypatch):
    from tunix_pipeline.models import load_model
    from tunix_pipeline.core import runtime
    from tunix_pipeline.train import checkpoints, loop
    from tunix_pipeline.train.sft import train

    from .test_export import _rows

    barriers = []
    monkeypatch.setattr(loop, "barrier", barriers.append)
    rows = _rows(n=16, length=24)  # micro-batches of 4 rows on the fsdp 4 x tp 2 mesh: 4 an epoch
    mesh = runtime.make_mesh(RuntimeParams(mesh={"fsdp": 4, "tp": 2}))
    model, _ = load_model(tiny_model_dir, mesh)
    sft = SftParams(max_steps=None, epochs=1.5, per_device_batch_size=1, gradient_accumulation_steps=2,
                    learning_rate=1e-2, checkpoint_every=100, checkpoint_dir=str(tmp_path / "ckpt"))
    result = train(model, rows, rows.head(0), sft, mesh)
    assert result["latest_step"] == 3  # 1.5 epochs x 4 micro-batches / 2 per step
    # every process leaves training together, after process 0 wrote the loss history (multi-host)
    assert barriers[-1] == "sft_end" and (tmp_path / "ckpt" / checkpoints.HISTORY_FILE).is_file()

