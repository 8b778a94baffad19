"""`plan`: the memory estimate against XLA, the seeds' examples, the table, and the sft guardrail."""

import json
import logging

import mlflow
import pytest
import yaml
from kedro.framework.session import KedroSession
from kedro.framework.startup import bootstrap_project

from tunix_pipeline.config import LoraParams, ModelParams, PlanParams, RuntimeParams, SftParams, TokenizeParams
from tunix_pipeline.planning import (
    DoesNotFit, TrainSetup, build_plan, estimate_memory, from_hf_config, markdown, resolve, xla,
)
from tunix_pipeline.models.architecture import lora_targets
from tunix_pipeline.planning.job import Job
from tunix_pipeline.planning.memory import GIB
from tunix_pipeline.planning.plan import evaluate, make_plan

from .conftest import ROOT

PLAN = PlanParams(**yaml.safe_load((ROOT / "conf" / "base" / "parameters_plan.yml").read_text())["plan"])
KNOWN = PLAN.architectures
TINY = resolve(ModelParams())
GEMMA_2B = from_hf_config(KNOWN["google/gemma-2b"], "google/gemma-2b")
LORA = LoraParams()
TARGETS = lora_targets(LORA.target_modules)


def _agree(arch, setup, lora=None, max_layers=4):
    got = xla.check(arch, setup, max_layers, lora)
    est = estimate_memory(arch, setup).peak
    print(f"{arch.name} {setup}: estimate {est / 2**20:.2f} MiB, XLA {got['peak'] / 2**20:.2f} MiB ({got['method']})")
    # an analytic memory model against XLA's buffer assignment: 20% is the model's accuracy, not rounding
    assert abs(est - got["peak"]) / got["peak"] < 0.2, (est, got)


# ---------------------------------------------------------------- estimate vs XLA
TINY_SETUP = TrainSetup(per_device_batch=2, seq_len=128, fsdp=4, tp=2, backend="cpu")


@pytest.mark.parametrize(
    "model, runtime, sft",
    [
        (ModelParams(), {"fsdp": 4, "tp": 2}, {}),
        (ModelParams(lora=LORA), {"fsdp": 8}, {}),
        (ModelParams(), {"fsdp": 4, "tp": 2},
         {"optimizer": "adafactor", "gradient_accumulation_steps": 2, "remat": "decoder", "compute_dtype": "bfloat16"}),
    ],
    ids=["full-4x2", "lora-8x1", "adafactor-accum-remat-bf16"],
)
def test_on_this_cpu_the_plan_rests_on_xla_cpus_figure_of_the_runs_own_step(model, runtime, sft):
    """The CPU profile is this machine: XLA:CPU compiles the very step the run will compile (its dtypes and remat
    as configured), and the plan's memory and FLOPs are that program's; the estimate, which counts what an
    accelerator's compiler keeps (every term with a mechanism, none fitted), is reported beside it."""
    from tunix_pipeline.planning import with_xla_check

    plan = _plan(model, "cpu", runtime=RuntimeParams(mesh={"data": 1, "tp": 1, **runtime}), **sft)
    checked = with_xla_check(plan, model, PLAN.model_copy(update={"hardware": "cpu"}))
    x, s = checked.xla, checked.selected
    assert x["compiler"] == "XLA:CPU" and x["topology"] == "this CPU" and x["dtype_note"] is None
    assert s.setup == plan.selected.setup  # nothing swapped: the bf16 compute and the remat as the run has them
    very = xla.check(checked.job.arch, s.setup, 4, model.lora)
    assert s.peak == very["peak"] and s.compiled_flops == very["flops"] * s.setup.devices * s.setup.grad_accum
    summary = checked.summary()
    assert summary["memory_from"] == summary["flops_from"] == "XLA:CPU"
    # XLA:CPU keeps more than an accelerator's compiler (no bf16 matmul, fewer fusions): the estimate is below it
    assert x["difference"] < 0 and summary["estimated_memory_per_device_gib"] < summary["memory_per_device_gib"]
    assert "compiled by XLA:CPU for this CPU" in markdown(checked) and "(XLA:CPU's figure for the compiled step" in markdown(checked)


def test_planned_on_this_cpu_the_devices_share_the_host_with_the_process_and_the_plan_says_its_peak():
    """`plan.hardware: auto` on a CPU: the devices' programs get the host's memory less what the planning process
    already holds (the runtime, the libraries, the data), and the plan says the process's resident peak."""
    import psutil

    from tunix_pipeline.planning.hardware import _host_memory_bytes
    from tunix_pipeline.planning.plan import process_peak_gib

    plan = _plan(ModelParams(), "auto")
    s = plan.selected
    held = psutil.Process().memory_info().rss / GIB
    assert s.profile == "cpu" and 0.5 * held < s.hw.process_gib <= held
    assert s.hw.memory_gib * s.hw.devices + s.hw.process_gib == pytest.approx(_host_memory_bytes() / GIB)
    summary = plan.summary()
    assert summary["process_peak_gib"] == process_peak_gib(s.hw, s.peak) == pytest.approx(
        s.hw.process_gib + s.hw.devices * s.peak / GIB, abs=1e-3)
    assert f"the process held {s.hw.process_gib:.2f} GiB of the host when planned" in markdown(plan)
    # GRPO's too: the larger of its phases beside what the process held
    from tunix_pipeline.config import GrpoParams
    from tunix_pipeline.planning import PlannedStage, stage_planning
    from tunix_pipeline.stages import GRPO

    grpo = GrpoParams(enabled=True, max_steps=2, batch_size=8, num_generations=4, max_prompt_length=64,
                      max_completion_length=64, checkpoint_every=1)
    g = stage_planning(GRPO).add_stage(plan, PlannedStage(grpo), ModelParams(), PLAN.model_copy(
        update={"hardware": "auto"}), RuntimeParams(mesh="auto")).polish[GRPO.name]["selected"]
    assert g["process_peak_gib"] == pytest.approx(
        s.hw.process_gib + s.hw.devices * max(g["update_gib"], g["generation_gib"]), abs=0.01)
    # the scoring's phases too, each beside what the process held
    from tunix_pipeline.config import EvaluateParams
    from tunix_pipeline.planning.scoring import add_scoring

    phase = add_scoring(plan, EvaluateParams(batch_size=4, max_new_tokens=32), 64, None, None).scoring["evaluation"]
    assert phase["process_peak_gib"] == pytest.approx(s.hw.process_gib + s.hw.devices * phase["gib"], abs=0.01)
    # a profile named with its memory is taken as it is: no process beside it
    assert _plan(ModelParams(), "cpu").summary()["process_peak_gib"] is None


def test_the_estimate_agrees_with_xla_for_a_gemma_2b_shaped_model():
    # every layer and the full 256k vocabulary, abstract shapes only; 1 and 2 layers compiled, extrapolated to 18
    _agree(GEMMA_2B, TrainSetup(per_device_batch=2, seq_len=512, fsdp=8, backend="cpu"), max_layers=4)


def test_layer_extrapolation_matches_compiling_every_layer():
    four = from_hf_config({**TINY.hf_config, "num_hidden_layers": 3}, "tiny-3-layers")
    setup = TINY_SETUP
    whole = xla.xla_peak(four, setup, max_layers=None)["peak"]
    extrapolated = xla.xla_peak(four, setup, max_layers=2)["peak"]
    assert abs(extrapolated - whole) / whole < 0.05


@pytest.mark.slow
def test_a_program_compiled_before_is_read_back_with_its_figures(tmp_path):
    import jax

    from tunix_pipeline.planning import compiled_figures

    figures = ("peak", "argument", "output", "alias", "temp", "flops", "bytes_accessed", "platform")
    kept = jax.config.jax_compilation_cache_dir
    jax.config.update("jax_compilation_cache_dir", str(tmp_path))
    compiled_figures._IN_PROCESS.clear()  # what earlier tests compiled here
    try:
        first = xla.compile_step(TINY, TINY_SETUP)
        assert "compiled_before" not in first
        again = xla.compile_step(TINY, TINY_SETUP)  # this process's copy
        compiled_figures._IN_PROCESS.clear()
        from_disk = xla.compile_step(TINY, TINY_SETUP)  # another process's: the file beside JAX's cache
        for result in (again, from_disk):
            assert result["compiled_before"] and {k: result[k] for k in figures} == {k: first[k] for k in figures}
        [entry] = (tmp_path / "xla-figures").glob("*.json")
        # another program is another entry; an unreadable entry is compiled again, and rewritten
        other = xla.compile_step(TINY, TINY_SETUP.replace(per_device_batch=1))
        assert "compiled_before" not in other and other["temp"] < first["temp"]
        compiled_figures._IN_PROCESS.clear()
        entry.write_text("{")
        recompiled = xla.compile_step(TINY, TINY_SETUP)
        assert "compiled_before" not in recompiled and recompiled["peak"] == first["peak"]
        assert json.loads(entry.read_text())["peak"] == first["peak"]
        # a refusal for memory is kept as XLA's message and raised again
        compiled_figures.write("refused", {"refused": "RESOURCE_EXHAUSTED: Ran out of memory in memory space hbm"})
        compiled_figures._IN_PROCESS.clear()
        with pytest.raises(compiled_figures.Refused, match="Ran out of memory in memory space hbm"):
            compiled_figures.read("refused")
        assert "read back" in xla.xla_peak(TINY, TINY_SETUP, max_layers=None)["method"]
    finally:
        jax.config.update("jax_compilation_cache_dir", kept)
        compiled_figures._IN_PROCESS.clear()


@pytest.mark.slow
def test_a_shipped_programs_figures_are_read_when_nothing_else_keeps_them(tmp_path, monkeypatch):
    # the shipped recipes' XLA:TPU programs come with their figures: read last, under the same key
    import jax

    from tunix_pipeline.planning import compiled_figures

    kept = jax.config.jax_compilation_cache_dir
    jax.config.update("jax_compilation_cache_dir", str(tmp_path / "cache"))
    compiled_figures._IN_PROCESS.clear()
    try:
        setup = TINY_SETUP.replace(per_device_batch=5)
        first = xla.compile_step(TINY, setup)
        [entry] = (tmp_path / "cache" / "xla-figures").glob("*.json")
        shipped = tmp_path / "shipped.json"
        shipped.write_text(json.dumps({"versions": compiled_figures.versions(),
                                       "figures": {entry.stem: json.loads(entry.read_text())}}))
        monkeypatch.setattr(compiled_figures, "SHIPPED", shipped)
        compiled_figures.shipped.cache_clear()
        entry.unlink()
        compiled_figures._IN_PROCESS.clear()  # a fresh machine: nothing compiled, the shipped file only
        again = xla.compile_step(TINY, setup)
        assert again["compiled_before"] and again["peak"] == first["peak"] and again["flops"] == first["flops"]
        # another program is not in it: compiled
        assert "compiled_before" not in xla.compile_step(TINY, setup.replace(per_device_batch=6))
    finally:
        jax.config.update("jax_compilation_cache_dir", kept)
        compiled_figures._IN_PROCESS.clear()
        compiled_figures.shipped.cache_clear()


@pytest.mark.slow  # a `kedro run --pipelines=plan` of its own
def test_shipping_plans_the_recipes_afresh_and_keeps_only_tpu_programs(tmp_path, monkeypatch):
    from tunix_pipeline.planning import compiled_figures

    monkeypatch.setattr(compiled_figures, "SHIPPED", tmp_path / "shipped.json")
    compiled_figures.shipped.cache_clear()
    kept = {"a" * 64: {"platform": "tpu", "peak": 1}}
    try:
        out = compiled_figures.ship(["gpu_smoke"], ROOT, keep=kept)  # its plan compiles XLA:CPU's step only
        assert out == {"versions": compiled_figures.versions(), "figures": kept}
        assert compiled_figures.shipped() == out  # the file as written is read back
    finally:
        compiled_figures.shipped.cache_clear()


def test_without_a_compilation_cache_the_figures_are_kept_in_the_temporary_folder(tmp_path, monkeypatch):
    # `kedro run` after `kedro run --pipelines=plan` reads back what the plan compiled, JAX's cache set or not
    import jax

    from tunix_pipeline.planning import compiled_figures

    kept = jax.config.jax_compilation_cache_dir
    jax.config.update("jax_compilation_cache_dir", None)
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    compiled_figures._IN_PROCESS.clear()
    try:
        first = xla.compile_step(TINY, TINY_SETUP.replace(per_device_batch=3))
        [entry] = (tmp_path / "tunix-pipeline-xla-figures").glob("*.json")
        compiled_figures._IN_PROCESS.clear()  # another process
        again = xla.compile_step(TINY, TINY_SETUP.replace(per_device_batch=3))
        assert again["compiled_before"] and again["peak"] == first["peak"] == json.loads(entry.read_text())["peak"]
    finally:
        jax.config.update("jax_compilation_cache_dir", kept)
        compiled_figures._IN_PROCESS.clear()


def test_parameter_count_is_the_abstract_models():
    from flax import nnx

    from tunix_pipeline.planning.xla import _tunix_config

    family, cfg = _tunix_config(GEMMA_2B, GEMMA_2B.num_layers, "none")
    abstract = nnx.eval_shape(lambda: family.model_class(cfg, rngs=nnx.Rngs(0)))
    assert sum(x.size for x in __import__("jax").tree.leaves(nnx.state(abstract, nnx.Param))) == GEMMA_2B.params
    assert 2.50e9 < GEMMA_2B.params < 2.52e9


def test_a_data_axis_is_gathered_not_split_by_tunix_models():
    # Tunix's models constrain activations to (fsdp, ..., tp) and never name `data`: on a data axis each
    # device computes all the rows of its group. The plan warns (below); XLA shows the cost
    on_data = xla.check(TINY, TINY_SETUP.replace(data=8, fsdp=1, tp=1))["peak"]
    on_fsdp = xla.check(TINY, TINY_SETUP.replace(data=1, fsdp=8, tp=1))["peak"]
    print(f"tiny, 2 x 128 per device: data 8 {on_data / 2**20:.2f} MiB, fsdp 8 {on_fsdp / 2**20:.2f} MiB")
    assert on_data > 1.3 * on_fsdp
    plan = _plan(ModelParams(), "cpu", runtime=RuntimeParams(mesh={"data": 2, "fsdp": 4}))
    assert plan.status == "risky" and any("runtime.mesh has data: 2" in w for w in plan.warnings)


def test_a_remat_run_for_a_gpu_is_checked_on_a_fake_cpu_mesh_without_remat():
    # no XLA:GPU here: the check compiles the step on a fake CPU mesh to inform, and the plan keeps its estimate;
    # XLA:CPU keeps the activations under remat anyway, so it compiles (and estimates) the step without it
    from tunix_pipeline.planning import check_against_xla

    model = ModelParams()
    plan = _plan(model, "a100-large", remat="decoder", per_device_batch_size=4)
    checked = check_against_xla(plan, model)
    assert "without remat (decoder)" in checked["dtype_note"] and "compiler" not in checked
    assert checked["platform"] == "cpu" and checked["difference"] < 0  # XLA:CPU keeps more than a GPU's compiler
    plan.xla = checked
    assert "compiled without remat (decoder)" in markdown(plan) and plan.summary()["memory_from"] == "estimate"

# ---------------------------------------------------------------- the seeds, in direction
def _fits(name, profile, mode="full", batch=4, length=512, dtype="bfloat16"):
    arch = from_hf_config(KNOWN[name], name)
    hw = PLAN.profiles[profile]
    setup = TrainSetup(per_device_batch=batch, seq_len=length, fsdp=hw.devices, param_dtype=dtype, backend=hw.kind,
                       mode=mode, lora_targets=TARGETS)
    peak = estimate_memory(arch, setup).peak
    return peak <= hw.memory_gib * GIB * PLAN.usable_memory_fraction, peak / GIB


def test_the_hardware_guides_examples():
    # seed 002: Qwen2.5-0.5B full fits t4-small; 1.5B full exceeds it; 1.5B LoRA fits
    assert _fits("Qwen/Qwen2.5-0.5B", "t4-small", batch=4)[0]
    assert not _fits("Qwen/Qwen2.5-1.5B", "t4-small", batch=2)[0]
    assert _fits("Qwen/Qwen2.5-1.5B", "t4-small", "lora", batch=2)[0]
    # its rule of thumb: full fine-tuning needs ~20 GB per billion parameters (fp32 weights and Adam)
    _, qwen_fp32 = _fits("Qwen/Qwen2.5-1.5B", "a100-large", batch=2, dtype="float32")
    assert 24 < qwen_fp32 < 36
    # and 7B full (fp32 weights) is not feasible on one 80 GB card, QLoRA is
    assert not _fits("Qwen/Qwen2.5-7B", "h100", batch=2, dtype="float32")[0]
    assert _fits("Qwen/Qwen2.5-7B", "t4-small", "qlora", batch=1)[0]


def test_gemma_2b_full_at_batch_4_and_length_1024_on_a_v5e_8():
    # seed 000/004's job: the estimate says it does not fit 16 GiB per chip without remat (~20 GiB: 18
    # layers of activations and gathered weights; the loss's logits are a chunk at a time), and says what would
    fits, gib = _fits("google/gemma-2b", "tpu-v5e-8", batch=4, length=1024)
    assert not fits and 16 < gib < 26
    plan = _plan(ModelParams(source="google/gemma-2b", dtype="bfloat16"), "kaggle-tpu-v5e-8", per_device_batch_size=4,
                 max_length=1024, max_steps=3000, checkpoint_every=1000)
    assert plan.status == "over"
    assert any(a.startswith("remat") for a in plan.advice)
    assert any(a.startswith("per-device batch 2") for a in plan.advice)
    assert plan.recommended is not None and plan.recommended.fits


def _plan(model, hardware, max_length=128, runtime=None, **sft):
    sft = SftParams(**{"max_steps": 100, "per_device_batch_size": 2, "learning_rate": 1e-3, "checkpoint_every": 50, **sft})
    plan = PLAN.model_copy(update={"hardware": hardware})
    return build_plan(model, sft, runtime or RuntimeParams(mesh="auto"), TokenizeParams(max_length=max_length), plan)


# ---------------------------------------------------------------- the table, recommendation and warnings
def test_every_profile_gets_a_row_and_the_cheapest_that_fits_is_recommended():
    plan = _plan(ModelParams(source="Qwen/Qwen2.5-0.5B", dtype="bfloat16"), "tpu-v5e-8", max_length=512,
                 per_device_batch_size=4, max_steps=2000)
    assert {r.profile for r in plan.rows} == set(PLAN.profiles)
    fitting = [r for r in plan.rows if r.fits and r.within_budget]
    assert plan.recommended.cost == min(r.cost for r in fitting)
    text = markdown(plan)
    assert "| tpu-v5e-8 **(this run)**" in text and "(recommended)" in text
    # a budget on time rules out the slow ones
    fast = PLAN.model_copy(update={"hardware": "tpu-v5e-8", "budget": PLAN.budget.model_copy(update={"max_hours": 1.0})})
    job = plan.job
    rows = [evaluate(job, n, p, fast) for n, p in fast.profiles.items()]
    best = make_plan(job, fast, ("tpu-v5e-8", fast.profiles["tpu-v5e-8"])).recommended
    assert best.hours <= 1.0 and best.cost == min(r.cost for r in rows if r.fits and r.within_budget)


def test_kaggle_sessions_and_the_weekly_quota():
    plan = _plan(ModelParams(source="google/gemma-2b", dtype="bfloat16"), "kaggle-tpu-v5e-8", max_length=512,
                 per_device_batch_size=1, max_steps=200_000, checkpoint_every=1000)
    row = plan.selected
    assert row.steps_per_session and row.sessions == -(-row.steps // row.steps_per_session)
    assert row.weeks == -(-row.hours // 20)
    # a checkpoint interval longer than a session: warned, not refused
    long = _plan(ModelParams(source="Qwen/Qwen2.5-0.5B", dtype="bfloat16"), "kaggle-tpu-v5e-8", max_length=1024,
                 per_device_batch_size=1, max_steps=4_000_000, checkpoint_every=2_000_000)
    assert long.selected.fits and long.selected.memory_fraction < 0.9
    assert long.status == "risky" and any("before the first checkpoint" in w for w in long.warnings)


def test_a_large_model_on_a_small_gpu_is_a_warning():
    model = ModelParams(source="Qwen/Qwen2.5-1.5B", dtype="bfloat16", lora=LoraParams())
    plan = _plan(model, "t4-small", max_length=256, per_device_batch_size=1)
    assert plan.status == "risky" and any("large model on a small GPU" in w for w in plan.warnings)


def test_over_90_percent_of_memory_is_a_warning():
    # Gemma-2B full bf16 without remat at 5 x 512 a chip, estimated (no XLA:TPU compile here): ~95% of 15.2 GiB
    plan = _plan(ModelParams(source="google/gemma-2b", dtype="bfloat16"), "kaggle-tpu-v5e-8", max_length=512,
                 per_device_batch_size=5)
    assert plan.selected.fits and plan.selected.memory_fraction > 0.9
    assert plan.status == "risky" and any("headroom" in w for w in plan.warnings)


def test_a_fitting_run_lists_what_its_spare_memory_would_hold():
    # tpu_full's step: with the loss's output layer a chunk at a time, float32 master weights fit beside it
    plan = _plan(ModelParams(source="google/gemma-2b", dtype="bfloat16"), "kaggle-tpu-v5e-8", max_length=1024,
                 per_device_batch_size=4, remat="decoder")
    assert plan.status == "ok" and not plan.advice
    assert plan.headroom[0].startswith("float32 master weights (model.dtype: float32, sft.compute_dtype: bfloat16)")
    assert any(h.startswith("per-device batch 8 (sft.per_device_batch_size: 8)") for h in plan.headroom)
    assert "**The memory it leaves would hold any of (estimates):**" in markdown(plan)
    assert plan.summary()["headroom"] == plan.headroom
    masters = _plan(ModelParams(source="google/gemma-2b", dtype="float32"), "kaggle-tpu-v5e-8", max_length=1024,
                    per_device_batch_size=4, remat="decoder", compute_dtype="bfloat16")
    assert not any(h.startswith("float32") for h in masters.headroom)


def test_a_job_always_has_the_configured_samples():
    plan = _plan(ModelParams(source="Qwen/Qwen2.5-0.5B", dtype="bfloat16"), "tpu-v5e-8", per_device_batch_size=4)
    assert isinstance(plan.job, Job) and plan.job.global_batch == 32
    for row in plan.rows:
        assert row.steps * row.global_batch >= plan.job.samples


# ---------------------------------------------------------------- Kedro: the plan pipeline and the sft guardrail
def _session(path, env=None, **runtime_params):
    bootstrap_project(path)
    return KedroSession.create(project_path=path, env=env, runtime_params=runtime_params or None)


@pytest.mark.slow
def test_the_plan_pipeline_writes_the_table_and_logs_it(project):
    # an earlier tokenize stage's report of this output root (the base length, 128): the plan reads its padding
    tokenized = {"max_length": 128, "examples_out": 400, "mean_length": 38.4, "padding_efficiency_unpacked": 0.3,
                 "padding_efficiency_packed": 0.95}
    (project / "data" / "08_reporting").mkdir(parents=True, exist_ok=True)
    (project / "data" / "08_reporting" / "tokenize_report.json").write_text(json.dumps({"train": tokenized}))
    with _session(project) as session:
        session.run(pipeline_names=["plan"])
    report = (project / "data" / "08_reporting" / "plan.md").read_text()
    summary = json.loads((project / "data" / "08_reporting" / "plan.json").read_text())
    assert "## Checked against XLA" in report and "## Every hardware profile" in report
    assert summary["goodput"]["padding_efficiency"] == 0.3 and "padding efficiency 0.30: 70% of each step" in report
    # this CPU: the plan rests on XLA:CPU's figure of the run's own step
    assert summary["status"] == "ok" and summary["memory_from"] == "XLA:CPU"
    assert summary["memory_per_device_gib"] == round(summary["xla_check"]["xla_gib"], 3)
    client = mlflow.MlflowClient(tracking_uri=f"sqlite:///{project / 'data' / 'mlflow.db'}")
    run = client.search_runs([e.experiment_id for e in client.search_experiments()])[0]
    assert "plan_report.md" in {a.path for a in client.list_artifacts(run.info.run_id)}
    assert run.data.metrics["plan_summary.memory_per_device_gib"] > 0


def test_the_plan_pipeline_plans_tpu_full_offline(project):
    # tpu_full plans for its Kaggle v5e-8 (conf/tpu_full); the XLA check is skipped here for time
    with _session(project, "tpu_full", plan={"xla_check": {"enabled": False}}) as session:
        session.run(pipeline_names=["plan"])
    summary = json.loads((project / "data" / "08_reporting" / "plan.json").read_text())
    assert summary["model"] == "google/gemma-2b" and summary["hardware"] == "kaggle-tpu-v5e-8"
    assert summary["global_batch"] == 32 and summary["mesh"] == {"data": 1, "fsdp": 8, "tp": 1}
    assert summary["status"] in ("ok", "risky")  # with remat and loss chunks, Gemma-2B full fits 16 GiB chips
    # no tokenize report in this output root: padding not counted; the recipe's packed rows hold plan.train_examples
    goodput = summary["goodput"]
    assert goodput["padding_efficiency"] is None and goodput["padding_note"].startswith("no tokenize report")
    assert goodput["packed"] and goodput["examples_per_hour"] == pytest.approx(summary["samples_per_hour"] * 7324 / 1236)
    assert " examples in a 9 h session" in goodput["session_quote"]
    assert goodput["session_quote"].endswith("seed 000 estimated ~100K samples in a 9 h session")


def test_sft_stops_before_reading_weights_when_the_run_cannot_fit(project, monkeypatch):
    import pandas as pd

    from tunix_pipeline.pipelines.sft import nodes as sft_nodes

    def read_weights(*args, **kwargs):
        raise AssertionError("weights were read")

    monkeypatch.setattr(sft_nodes, "load_run_model", read_weights)
    (project / "conf" / "local" / "parameters.yml").write_text(
        "plan:\n  hardware: small\n  profiles:\n"
        "    small: {kind: tpu, devices: 8, memory_gib: 0.001, peak_tflops: 1}\n"
        "tracking:\n  enabled: false\n"
    )
    # the sft stage's inputs, as the earlier stages leave them (the tiny model is planned from its parameters)
    rows = pd.DataFrame({"id": ["a", "b"], "input_tokens": [[1] * 128] * 2, "loss_mask": [[1] * 128] * 2,
                         "segment_ids": [[1] * 128] * 2, "positions": [list(range(128))] * 2})
    for name, folder in (("train_tokens", "05_model_input"), ("eval_tokens", "05_model_input")):
        (project / "data" / folder).mkdir(parents=True, exist_ok=True)
        rows.to_parquet(project / "data" / folder / f"{name}.parquet")
    (project / "data" / "03_primary").mkdir(parents=True, exist_ok=True)
    formatted = pd.DataFrame([{"id": "a", "source": "s", "prompt": "1 + 1?", "completion": "2", "answer": "2",
                               "open_ended": False, "split": "eval"}])
    for name in ("eval_formatted", "eval_few_shot"):
        formatted.to_parquet(project / "data" / "03_primary" / f"{name}.parquet")
    (project / "data" / "02_intermediate").mkdir(parents=True, exist_ok=True)
    (project / "data" / "02_intermediate" / "base_model.json").write_text(json.dumps({"path": "data/06_models/base_model"}))
    with _session(project) as session, pytest.raises(DoesNotFit) as err:
        session.run(pipeline_names=["sft"])
    message = str(err.value)
    print(message)
    assert "does not fit small" in message and "over by" in message and "It would fit with any of" in message
    assert not (project / "data" / "06_models" / "sft_checkpoints").exists()
    assert not (project / "data" / "06_models" / "sft_result.json").exists()


def test_the_preflight_warns_and_goes_on_when_risky(caplog):
    import pandas as pd

    from tunix_pipeline.pipelines.sft.nodes import check_sft_fits

    plan = PLAN.model_copy(update={"hardware": "t4-small"})
    model = ModelParams(source="Qwen/Qwen2.5-1.5B", dtype="bfloat16", lora=LoraParams())
    sft = SftParams(max_steps=10, per_device_batch_size=1, learning_rate=1e-4, checkpoint_every=5)
    rows = pd.DataFrame({"input_tokens": [[1] * 256] * 4})
    base = {"path": "nowhere"}
    with caplog.at_level(logging.WARNING):
        passed, summary = check_sft_fits(base, rows, None, model, sft, RuntimeParams(), TokenizeParams(max_length=256), plan)
    assert passed is base and summary["status"] == "risky"
    assert "large model on a small GPU" in caplog.text
    off = plan.model_copy(update={"enabled": False})
    assert check_sft_fits(base, rows, None, model, sft, RuntimeParams(), TokenizeParams(max_length=256), off)[1] == {"status": "skipped"}


@pytest.mark.parametrize("family", ["gemma3-mqa", "gemma3-mha", "gemma3-gqa-attention-only", "qwen3"])
def test_the_plans_adapter_count_is_the_models(tmp_path, family):
    """The plan's LoRA adapters (their weights, gradients, optimizer state and checkpoint bytes) count what qwix puts
    on Tunix's model: Gemma's fused kv (or qkv) einsum takes one adapter, its input side once."""
    import transformers

    from tunix_pipeline.models import load_run_model, parameter_counts
    from tunix_pipeline.models.hub import read_hf_config
    from tunix_pipeline.models.architecture import from_hf_config

    from .parity import save_hf_model

    shape = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 head_dim=16, pad_token_id=0)
    gemma = {**shape, "query_pre_attn_scalar": 16}
    config, lora = {
        "gemma3-mqa": (transformers.Gemma3TextConfig(**gemma, num_key_value_heads=1), LoraParams(rank=4)),
        "gemma3-mha": (transformers.Gemma3TextConfig(**gemma, num_key_value_heads=4), LoraParams(rank=4)),
        "gemma3-gqa-attention-only": (transformers.Gemma3TextConfig(**gemma, num_key_value_heads=2),
                                      LoraParams(rank=4, target_modules=".*attn.*(kv_einsum|q_einsum).*")),
        "qwen3": (transformers.Qwen3Config(**shape, num_key_value_heads=2), LoraParams(rank=4)),
    }[family]
    folder = save_hf_model(config, tmp_path / family)
    model, _ = load_run_model(folder, ModelParams(lora=lora), None)
    arch = from_hf_config(read_hf_config(folder))
    assert arch.lora_params(lora.rank, lora_targets(lora.target_modules)) == parameter_counts(model)["trainable_params"]
