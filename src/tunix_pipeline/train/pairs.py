"""Preference pairs: built from the SFT model's own samples scored with GRPO's rewards (`pairs_from_rewards`), and
tokenized ahead of training into the fixed shapes Tunix's DPO trainer takes (`tokenize_pairs`: prompt left-padded,
answers right-padded; a pair that does not fit is dropped and counted, never truncated into another preference)."""

from __future__ import annotations

import logging

import numpy as np
import pandas as pd

from tunix_pipeline.config import EvaluateParams, PreferenceParams
from tunix_pipeline.core.errors import ModelError
from tunix_pipeline.data.formatting import end_of_turn
from tunix_pipeline.data.tokenization import encode_batch, stack
from tunix_pipeline.generate.generation import Generator, fitting_prompts
from tunix_pipeline.train.rewards import REWARD_COLUMNS
from tunix_pipeline.upstream import REFERENCE_COLUMNS

log = logging.getLogger(__name__)

PAIR_TOKEN_COLUMNS = ["prompt_ids", "prompt_mask", "chosen_ids", "chosen_mask", "rejected_ids", "rejected_mask"]
PAIR_COLUMNS = ["id", "source", "prompt", "completion", "rejected", "answer"]
REWARD_PAIR_COLUMNS = PAIR_COLUMNS + ["chosen_reward", "rejected_reward"]


def pairs_from_rewards(model, tokenizer, formatted: pd.DataFrame, params: PreferenceParams, rewards, mesh,
                       max_prompts: int, decode_weights: str = "sharded") -> tuple[pd.DataFrame, dict]:
    """(pairs, counts): `k` samples per prompt with `generation`'s sampler (`decode_weights`:
    `runtime.decode_weights`), scored with GRPO's rewards; per prompt the best and the worst sample, kept where
    their weighted total rewards differ by at least `margin`.

    A sample that stopped by itself gets the end-of-turn marker SFT taught (one cut off at
    `max_new_tokens` does not), so a pair's answers read as the training data's do.
    """
    spec = params.from_rewards
    rows, too_long = fitting_prompts(formatted.head(max_prompts), tokenizer, params.max_prompt_length,
                                     setting="preference.max_prompt_length")
    counts = {"prompts": len(rows), "prompts_too_long": too_long, "samples": len(rows) * spec.num_samples}
    if not len(rows):
        return pd.DataFrame(columns=REWARD_PAIR_COLUMNS), {**counts, "pairs": 0, "below_margin": 0, "equal_rewards": 0}
    sampling = EvaluateParams(
        num_prompts=len(rows), max_new_tokens=spec.max_new_tokens, batch_size=spec.batch_size,
        temperature=spec.temperature, top_p=spec.top_p, top_k=spec.top_k, num_samples=spec.num_samples, seed=spec.seed,
        stop_repeats=None,  # a row that ran short closed its turn (the pair's text says so): none is cut by the rule
    )
    with mesh:
        texts, lengths = Generator(model, tokenizer, sampling, params.max_prompt_length,
                                   decode_weights)(rows["prompt"].tolist())
    closing = end_of_turn(tokenizer)
    k = spec.num_samples
    completions = [t + closing if n < spec.max_new_tokens else t for t, n in zip(texts, lengths)]
    columns = {key: np.repeat(rows[column].astype(str).to_numpy(), k) for key, column in REWARD_COLUMNS.items()
               if column in rows}
    total = rewards.score(np.repeat(rows["prompt"].to_numpy(), k), texts, **columns)["total"].reshape(-1, k)
    best, worst = total.argmax(axis=1), total.argmin(axis=1)
    gap = total[np.arange(len(rows)), best] - total[np.arange(len(rows)), worst]
    keep = gap >= max(spec.margin, 1e-9)
    out = []
    for i in np.flatnonzero(keep):
        row = rows.iloc[i]
        out.append({"id": row["id"], "source": row["source"], "prompt": row["prompt"],
                    "completion": completions[i * k + best[i]], "rejected": completions[i * k + worst[i]],
                    "answer": row["answer"], "chosen_reward": float(total[i, best[i]]),
                    "rejected_reward": float(total[i, worst[i]])})
    counts.update(pairs=len(out), below_margin=int((~keep).sum()), equal_rewards=int((gap == 0).sum()),
                  largest_reward_gap=float(gap.max()), mean_reward=float(total.mean()))
    return pd.DataFrame(out, columns=REWARD_PAIR_COLUMNS), counts


def tokenize_pairs(formatted: pd.DataFrame, tokenizer, params: PreferenceParams) -> tuple[pd.DataFrame, dict]:
    """Formatted pairs (prompt, completion = chosen, rejected) -> DPOTrainer's fixed-shape inputs, and counts.

    Prompts are left-padded to `max_prompt_length`, answers right-padded to `max_response_length`;
    the texts are encoded as SFT encodes them (the rendered prompt already holds the BOS, an answer
    gets none). A pair whose prompt or either answer does not fit is dropped and counted, as is a
    pair whose answers are the same tokens.
    """
    if tokenizer.pad_token_id is None:
        raise ModelError("the tokenizer has no pad token; add one to the model folder's tokenizer_config.json")
    n, pad = len(formatted), tokenizer.pad_token_id
    p_len, r_len = params.max_prompt_length, params.max_response_length
    texts = formatted["prompt"].tolist() + formatted["completion"].tolist() + formatted["rejected"].tolist()
    encoded = encode_batch(tokenizer, texts) if n else []
    prompts, chosen, rejected = encoded[:n], encoded[n : 2 * n], encoded[2 * n :]
    dropped = {"prompt_too_long": 0, "response_too_long": 0, "same_tokens": 0}
    keep = []
    for i in range(n):
        if len(prompts[i]) > p_len:
            dropped["prompt_too_long"] += 1
        elif max(len(chosen[i]), len(rejected[i])) > r_len:
            dropped["response_too_long"] += 1
        elif chosen[i] == rejected[i]:
            dropped["same_tokens"] += 1
        else:
            keep.append(i)
    arrays = {c: np.full((len(keep), p_len if c.startswith("prompt") else r_len), 0, np.int32) for c in PAIR_TOKEN_COLUMNS}
    for name in ("prompt_ids", "chosen_ids", "rejected_ids"):
        arrays[name][:] = pad
    for row, i in enumerate(keep):
        p = prompts[i]
        arrays["prompt_ids"][row, p_len - len(p):] = p
        arrays["prompt_mask"][row, p_len - len(p):] = 1
        for side, tokens in (("chosen", chosen[i]), ("rejected", rejected[i])):
            arrays[f"{side}_ids"][row, : len(tokens)] = tokens
            arrays[f"{side}_mask"][row, : len(tokens)] = 1
    frame = pd.DataFrame({"id": formatted["id"].astype(str).to_numpy()[keep] if n else [],
                          **{c: list(a) for c, a in arrays.items()}})
    stats = {
        "pairs_in": n,
        "pairs_out": len(keep),
        "dropped": dropped,
        "max_prompt_length": p_len,
        "max_response_length": r_len,
        "max_seen_prompt": max((len(p) for p in prompts), default=0),
        "max_seen_response": max((len(t) for t in chosen + rejected), default=0),
    }
    if sum(dropped.values()):
        log.warning("preference: dropped %s of %d pairs (never truncated); raise preference.max_prompt_length / "
                    "max_response_length to keep them", dropped, n)
    return frame, stats


def pair_arrays(rows: pd.DataFrame) -> dict[str, np.ndarray]:
    """The pair columns as 2-D int arrays (float for precomputed reference log-probs)."""
    out = {c: stack(rows, c) for c in PAIR_TOKEN_COLUMNS}
    for c in REFERENCE_COLUMNS:
        if c in rows:
            out[c] = rows[c].to_numpy(np.float32)
    return out


def why_too_few(report: dict, dropped: dict, params: PreferenceParams) -> tuple[str, str]:
    """(why the training pairs are too few, which settings to change), from the pairs report and the pairs
    tokenizing dropped: e.g. 'all 4 samples of each of 64 prompts scored equal rewards'."""
    causes, fixes = [], []
    train = report.get("train") or {}
    if report.get("pairs") == "from_rewards":
        spec, k = params.from_rewards, params.from_rewards.num_samples
        if not train.get("prompts"):
            causes.append(f"no training prompt fits preference.max_prompt_length={params.max_prompt_length} "
                          f"({train.get('prompts_too_long', 0)} too long)")
            fixes.append("raise preference.max_prompt_length")
        else:
            prompts, equal, below = train["prompts"], train.get("equal_rewards", 0), train.get("below_margin", 0)
            if equal == prompts:
                causes.append(f"all {k} samples of each of the {prompts} prompts scored equal rewards")
            elif below:
                causes.append(f"{below} of {prompts} prompts' best and worst of {k} samples differ by less than "
                              f"preference.from_rewards.margin={spec.margin} ({equal} scored all equal; the largest "
                              f"difference: {train.get('largest_reward_gap', 0):.3g})")
            fixes.append("lower preference.from_rewards.margin, raise from_rewards.num_samples, temperature or "
                         "max_prompts, or train SFT further so its samples differ in reward")
    else:
        rows = (report.get("data_quality") or {}).get("totals", {}).get("train_rows", "too few")
        causes.append(f"preference.data gave {rows} training pairs")
        fixes.append("add pairs to preference.data")
    if dropped and sum(dropped.values()):
        causes.append(f"tokenizing dropped {dropped}")
        fixes.append("raise preference.max_prompt_length / max_response_length")
    fixes.append("lower preference.per_device_batch_size")
    return "; ".join(causes), ", or ".join(fixes)
