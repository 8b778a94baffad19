"""The benchmark scripts run (on a tiny size, in seconds); no timing is asserted here."""

from types import SimpleNamespace

import jax
import pytest

from benchmarks import common, cpu_sft, gpu_sft, tokenize_rows
from tunix_pipeline.train.loop import BatchFeed


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    return common.write_gemma_folder(tmp_path_factory.mktemp("bench") / "gemma", common.GEMMA_TINY)


def _worker(name, folder, *extra):
    return cpu_sft.main(
        ["--worker", name, "--model", str(folder), "--size", "tiny", "--batch", "2", "--seq", "32",
         "--steps", "2", "--warmup", "0", *extra]
    )


def test_the_same_folder_feeds_ours_tunix_and_torch_with_the_same_first_loss(tiny_folder):
    from tunix_pipeline.models import load_model

    model, _ = load_model(tiny_folder, None)
    params = sum(x.size for x in jax.tree.leaves(__import__("flax").nnx.state(model)))
    assert params == common.parameter_count(common.GEMMA_TINY)

    ours = _worker("ours", tiny_folder)
    tunix = _worker("tunix_default", tiny_folder)
    torch = _worker("torch", tiny_folder)
    for result in (ours, tunix, torch):
        assert result["steps_timed"] == 2 and result["tokens_per_s"] > 0 and result["peak_rss_mb"] > 0
    # the same batches: the same non-padding share, counted from the rows each step was fed
    rows = cpu_sft._rows(SimpleNamespace(size="tiny", batch=2, seq=32))
    feed = BatchFeed(rows, 2, seed=cpu_sft._sft_params(SimpleNamespace(batch=2, warmup=0, steps=2), "unused").seed)
    useful = [int((feed.batch(i)["segment_ids"] > 0).sum()) for i in (1, 2)]  # the timed steps, after the compiling one
    for result in (ours, tunix, torch):
        assert result["padding_fraction"] == pytest.approx(1 - sum(useful) / (2 * 2 * 32))
        assert 0 < result["useful_tokens_per_s"] < result["tokens_per_s"]
        assert result["useful_gflops_per_s"] / result["gflops_per_s"] == pytest.approx(
            result["useful_tokens_per_s"] / result["tokens_per_s"])
    assert ours["train_step_compiles"] == 1 and tunix["train_step_compiles"] == 1
    # identical weights, batches and loss definition: the first losses agree across frameworks up to
    # float32 rounding in another order: 2 x (layers + 1) x width x eps x max|logit| (see parity.logits_atol:
    # 2 x 2 x 64 x 1.2e-7 x 0.9, logits of this random model stay below 1) plus 64 tokens x eps x loss,
    # about 8e-5 absolute, below 1e-4 x 6.2
    assert ours["first_loss"] == pytest.approx(tunix["first_loss"], rel=1e-4)
    assert ours["first_loss"] == pytest.approx(torch["first_loss"], rel=1e-4)


def test_ratios_and_targets_are_computed_from_the_contenders():
    out = {
        "matmul": {"matmul_peak_gflops": 200.0},
        "ours": {"tokens_per_s": 1000.0, "gflops_per_s": 130.0},
        "tunix_default": {"tokens_per_s": 700.0, "gflops_per_s": 91.0},
        "torch": {"tokens_per_s": 400.0, "gflops_per_s": 52.0},
    }
    r = cpu_sft._ratios(out)
    assert r["ours_mfu"] == pytest.approx(0.65)
    assert r["ours_vs_tunix_default"] == pytest.approx(1000 / 700)
    assert r["targets"] == {"ours_mfu >= 0.60": True, "ours_vs_tunix_default >= 1.3": True, "ours_vs_torch >= 2": True}


def test_tokenize_benchmark_compares_the_stage_with_a_plain_call():
    result = tokenize_rows.main(["--rows", "200", "--repeats", "1"])
    assert result["rows"] == 200 and result["ours_rows_per_s"] > 0 and result["plain_rows_per_s"] > 0
    assert result["ours_useful_tokens_per_s"] == pytest.approx(result["padding_efficiency"] * result["ours_tokens_per_s"])


def test_gpu_benchmark_skips_cleanly_without_a_gpu():
    if gpu_sft.gpu_devices():
        pytest.skip("a GPU is present: the real benchmark runs instead")
    assert gpu_sft.main([])["skipped"] == "no GPU"


def test_gpu_peak_table_knows_the_usual_cards():
    assert gpu_sft.table_peak("NVIDIA H100 80GB HBM3") == 989e12
    assert gpu_sft.table_peak("NVIDIA A100-SXM4-40GB") == 312e12
    assert gpu_sft.table_peak("Tesla T4") == 65e12
    assert gpu_sft.table_peak("some new card") is None


def test_the_trainer_builds_its_steps_with_the_cpu_compile_options():
    from flax import nnx

    from tunix_pipeline import upstream
    from tunix_pipeline.core import runtime

    options = runtime.step_compiler_options()
    assert options == runtime.CPU_COMPILER_OPTIONS  # JAX runs on the CPU here
    original = jax.jit
    with upstream.jit_with_options(options):
        step = nnx.jit(lambda x: x + 1)
    assert jax.jit is original
    info = getattr(step.jitted_fn, "_jit_info", None)
    if info is not None:  # a private detail of jax.jit: checked where it exists
        assert dict(info.compiler_options_kvs) == options
    assert int(step(jax.numpy.ones(()))) == 2


@pytest.mark.slow
def test_harness_benchmark_times_ours_and_lm_evals_hf_backend_on_the_same_task():
    pytest.importorskip("lm_eval")
    from benchmarks import harness_throughput

    result = harness_throughput.main(["--size", "tiny", "--limit", "2", "--batch", "2", "--max-gen-toks", "4"])
    for work in ("generate_until", "loglikelihood"):
        assert result[work]["items"] == 2 and result[work]["ours_per_s"] > 0 and result[work]["hf_per_s"] > 0
    assert result["loglikelihood"]["max_abs_difference"] < 1e-4  # the same weights: see tests/test_harness.py


@pytest.mark.slow  # ~100 s: both generators in processes of their own
def test_generation_benchmark_times_ours_and_transformers_on_the_same_ids(tiny_model_dir):
    """The generation benchmark's keys on a tiny model: ours and transformers decode the same greedy tokens from
    the same prompt ids, ours compiles nothing while timed, and a group of one prompt is prefilled once."""
    from benchmarks import generation

    result = generation.main(["--model", str(tiny_model_dir), "--engines", "ours", "transformers", "--batches", "2",
                              "--prompt-lengths", "16", "--new-tokens", "4", "--repeats", "1"])
    assert not result["failed"], result["failed"]
    runs = {(r["engine"], r["batch"], r["grouped"]): r for r in result["runs"]}
    assert set(runs) == {(e, 2, grouped) for e in ("ours", "transformers") for grouped in (False, True)} | {
        ("ours_ungrouped", 2, True)}
    for run in result["runs"]:
        assert run["decode_tokens_per_sec"] > 0 and 0 < run["roofline_fraction"] and run["peak_rss_mb"] > 0
    for key in runs:
        assert runs[key]["first_tokens"] == runs[("transformers", *key[1:])]["first_tokens"]
    assert all(runs[k]["compiles_timed"] == 0 for k in runs if k[0].startswith("ours"))
    for key in [k for k in runs if k[0].startswith("ours")]:  # the step's parts: its output layer, XLA's operations
        assert 0 < runs[key]["output_layer_ms"] < runs[key]["decode_step_ms"] and runs[key]["ops_per_decode_step"] > 10
    assert runs[("ours", 2, True)]["prefilled_tokens"] == 16 and runs[("ours_ungrouped", 2, True)]["prefilled_tokens"] == 32
    assert {"vs_transformers", "vs_ours_ungrouped"} <= set(result["ratios"][-1])


def test_grpo_cpu_splits_each_step_and_assembles_the_result():
    from benchmarks import grpo_cpu

    # steps end at 10, 13, 17 s (the first started at 0): 10 s (compiling, not timed), then 3 s and 4 s
    split = grpo_cpu.split_steps([10.0, 13.0, 17.0], 0.0, [6.0, 1.0, 2.0], [0.5, 0.25, 0.75])
    assert split["each_step_seconds"] == [10.0, 3.0, 4.0] and split["steps_timed"] == 2
    assert split["step_seconds"] == pytest.approx(3.5) and split["generation_seconds"] == pytest.approx(1.5)
    assert split["scoring_seconds"] == pytest.approx(0.5) and split["update_seconds"] == pytest.approx(1.5)
    ours = grpo_cpu.summary(split, completions_per_step=8)
    assert ours["completions_per_hour"] == pytest.approx(8 * 3600 / 3.5)
    trl = {**ours, "completions_per_hour": ours["completions_per_hour"] / 4}
    settings = grpo_cpu.make_settings(grpo_cpu.parser().parse_args(["--quick"]))
    assert (settings["batch_size"], settings["num_generations"], settings["total_steps"]) == (1, 2, 3)
    assert settings["beta"] == 0.04 and settings["lora_rank"] == 16  # GrpoParams' and LoraParams' defaults
    result = grpo_cpu.assemble(ours, trl, settings, common.machine())
    assert result["ratio_vs_trl"] == pytest.approx(4.0)
    assert list(result["ours"])[: len(grpo_cpu.KEYS)] == list(grpo_cpu.KEYS)
    assert "first (compiling) step is excluded" in result["timing"]


@pytest.mark.slow
def test_grpo_cpu_feeds_ours_and_trl_the_same_prompts(tiny_model_dir):
    pytest.importorskip("trl")
    from benchmarks import grpo_cpu

    args = ["--quick", "--steps", "1", "--max-completion-length", "4", "--max-prompt-length", "512", "--max-rows", "16"]
    settings = grpo_cpu.make_settings(grpo_cpu.parser().parse_args(args))
    ours = grpo_cpu.worker_ours(settings, str(tiny_model_dir))
    trl = grpo_cpu.worker_trl(settings, str(tiny_model_dir))
    for r in (ours, trl):
        assert r["steps_timed"] == 1 and r["steps_trained"] == 2 and r["completions_per_hour"] > 0
        assert r["generation_seconds"] > 0 and r["update_seconds"] > 0 and r["peak_rss_mb"] > 0
        assert 1 <= r["mean_completion_tokens"] <= 4
        assert 0 < r["cpu_user_seconds"] and 0 <= r["cpu_system_seconds"]
    assert ours["prompt_ids"] == trl["prompt_ids"] and ours["mean_prompt_tokens"] == trl["mean_prompt_tokens"]


def test_judge_benchmarks_time_the_judge_and_rank_its_scores(tiny_model_dir):
    from benchmarks import judge_cpu, judge_throughput

    prompts = [f"<bos><start_of_turn>user\nWhat is {i} x 3?<end_of_turn>\n<start_of_turn>model\n" for i in range(3)]
    completions = [f"<reasoning>{i} x 3</reasoning><answer>{3 * i}</answer>" for i in range(3)]
    run = judge_throughput.measure(str(tiny_model_dir), "label", 2, "float32", prompts, completions, repeats=1)
    assert run["rubrics"] == 3 and run["calls"] == 2 and run["malformed"] == 0
    assert run["rubrics_per_sec"] > 0 and run["useful_tokens_per_sec"] > run["rubrics_per_sec"]
    assert judge_cpu.auc([0.9, 0.8, 0.1], [True, True, False]) == 1.0
    assert judge_cpu.auc([0.5, 0.5], [True, False]) == 0.5 and judge_cpu.auc([1.0], [True]) is None
