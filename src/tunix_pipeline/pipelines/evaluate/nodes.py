import pandas as pd

from tunix_pipeline import evaluation
from tunix_pipeline.config import EvaluateParams, ModelParams, RuntimeParams
from tunix_pipeline.models import load_run_model, load_tokenizer
from tunix_pipeline.training import make_mesh, evaluate_loss, restore_latest


def evaluate_models(
    eval_tokens: pd.DataFrame,
    eval_formatted: pd.DataFrame,
    base_model: dict,
    sft_result: dict,
    model: ModelParams,
    params: EvaluateParams,
    runtime: RuntimeParams,
) -> tuple[dict, pd.DataFrame, str]:
    """The same metrics for the base and the fine-tuned model: loss on every eval row, generation on a few."""
    if not len(eval_tokens):
        raise ValueError("evaluate: the eval split is empty; set `ingest.eval_fraction` above 0")
    mesh = make_mesh(runtime)
    tokenizer = load_tokenizer(base_model["path"])
    # a QLoRA run is evaluated on its full-precision base, as it is exported
    network, _ = load_run_model(base_model["path"], model, mesh, quantize=False)
    batch_size = sft_result["global_batch_size"]
    held_out = eval_formatted.head(params.num_prompts)
    prompts = held_out["prompt"].tolist()
    cache_size = evaluation.prompt_budget(tokenizer, prompts, params.max_new_tokens) if prompts else 0

    def measure(label: str):
        metrics = {f"eval_{k}": v for k, v in evaluate_loss(network, eval_tokens, batch_size, mesh).items()}
        if not prompts:
            return metrics, pd.DataFrame(columns=evaluation.SAMPLE_COLUMNS)
        with mesh:
            generated = evaluation.generate(network, tokenizer, prompts, params, cache_size)
        scores, samples = evaluation.score(label, held_out, generated, params)
        return {**metrics, **scores}, samples

    results, samples = {}, []
    if params.compare_base_model:
        results["base"], base_samples = measure("base")
        samples.append(base_samples)
    step = restore_latest(network, sft_result["checkpoint_dir"])
    if step == 0:
        raise ValueError(f"evaluate: no SFT checkpoint in {sft_result['checkpoint_dir']}; run the `sft` pipeline first")
    results["tuned"], tuned_samples = measure("tuned")
    results["tuned"]["checkpoint_step"] = step
    samples.append(tuned_samples)
    report = "# Evaluation\n\n" + evaluation.markdown_table(results)
    return results, pd.concat(samples, ignore_index=True), report
