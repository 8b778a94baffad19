"""Evaluation: eval loss, generation with Tunix's sampler, answer accuracy and format compliance."""

from __future__ import annotations

import math

import pandas as pd

from tunix_pipeline.config import EvaluateParams
from tunix_pipeline.formatting import GEMMA_END_OF_TURN, extract_answer, is_well_formed

SAMPLE_COLUMNS = ["model", "id", "prompt", "reference", "generated", "extracted", "correct", "well_formed"]


def answers_match(predicted: str | None, reference: str, tolerance: float) -> bool:
    """Exact match after trimming, or numeric equality within `tolerance`."""
    if predicted is None:
        return False
    a, b = predicted.strip().replace(",", ""), reference.strip().replace(",", "")
    if a == b:
        return True
    try:
        return math.isclose(float(a), float(b), rel_tol=0.0, abs_tol=tolerance)
    except ValueError:
        return False


def generate(model, tokenizer, prompts: list[str], params: EvaluateParams, cache_size: int) -> list[str]:
    """Completions for `prompts` with Tunix's KV-cache sampler (greedy when temperature is 0)."""
    from tunix.generate import sampler as sampler_lib

    cfg = model.config
    sampler = sampler_lib.Sampler(
        transformer=model,
        tokenizer=tokenizer,
        cache_config=sampler_lib.CacheConfig(
            cache_size=cache_size, num_layers=cfg.num_layers, num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim
        ),
    )
    stop = [tokenizer.eos_token_id]
    if GEMMA_END_OF_TURN in tokenizer.get_vocab():
        stop.append(tokenizer.convert_tokens_to_ids(GEMMA_END_OF_TURN))
    prompt_len = cache_size - params.max_new_tokens
    sampled = dict(temperature=params.temperature, top_p=1.0, seed=0) if params.temperature > 0 else {}
    outputs = []
    for start in range(0, len(prompts), params.batch_size):
        chunk = prompts[start : start + params.batch_size]
        # pad the batch to a fixed size: one compiled shape for every chunk
        padded = chunk + [chunk[-1]] * (params.batch_size - len(chunk))
        out = sampler(
            padded,
            max_generation_steps=params.max_new_tokens,
            max_prompt_length=prompt_len,
            eos_tokens=stop,
            **sampled,
        )
        outputs.extend(out.text[: len(chunk)])
    return outputs


def prompt_budget(tokenizer, prompts: list[str], max_new_tokens: int) -> int:
    """A power-of-two KV cache that holds the longest prompt plus the new tokens."""
    longest = max(len(tokenizer(p, add_special_tokens=True)["input_ids"]) for p in prompts)
    prompt_len = 1 << (longest - 1).bit_length()
    return prompt_len + max_new_tokens


def score(label: str, formatted: pd.DataFrame, generated: list[str], params: EvaluateParams) -> tuple[dict, pd.DataFrame]:
    rows = []
    for record, text in zip(formatted.to_dict(orient="records"), generated):
        text = text.replace(GEMMA_END_OF_TURN, "").strip()
        extracted = extract_answer(text)
        rows.append(
            {
                "model": label,
                "id": record["id"],
                "prompt": record["prompt"],
                "reference": record["answer"],
                "generated": text,
                "extracted": extracted,
                "correct": answers_match(extracted, record["answer"], params.numeric_tolerance),
                "well_formed": is_well_formed(text),
            }
        )
    samples = pd.DataFrame(rows, columns=SAMPLE_COLUMNS)
    n = len(samples)
    metrics = {
        "prompts": n,
        "answer_accuracy": float(samples["correct"].mean()) if n else 0.0,
        "format_compliance": float(samples["well_formed"].mean()) if n else 0.0,
        "mean_completion_chars": float(samples["generated"].str.len().mean()) if n else 0.0,
    }
    return metrics, samples


def markdown_table(metrics: dict[str, dict]) -> str:
    """Models side by side: one column per model, one row per metric."""
    models = list(metrics)
    names = [k for k in metrics[models[0]] if isinstance(metrics[models[0]][k], (int, float))]
    lines = ["| metric | " + " | ".join(models) + " |", "|---|" + "---|" * len(models)]
    for name in names:
        cells = [f"{metrics[m][name]:.4g}" if isinstance(metrics[m][name], float) else str(metrics[m][name]) for m in models]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"
