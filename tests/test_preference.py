"""Preference polish: the losses against the papers' formulas, pair tokenization, the trainer."""

import math

import numpy as np
import pytest

# ---------------------------------------------------------------- the papers' formulas, written out independently
# (plain Python floats; nothing here imports the project's loss code)


def log_sigmoid(x: float) -> float:
    return -math.log1p(math.exp(-x)) if x >= 0 else x - math.log1p(math.exp(x))


def dpo_paper(c, r, c_ref, r_ref, beta, eps):
    """Rafailov et al. eq. 7 on summed log-probs; conservative DPO's label smoothing eps."""
    h = beta * ((c - c_ref) - (r - r_ref))
    return -(1 - eps) * log_sigmoid(h) - eps * log_sigmoid(-h)


def simpo_paper(c, r, n_c, n_r, beta, gamma, eps):
    """Meng et al. eq. 6: length-normalised rewards beta/|y| log pi(y|x), target margin gamma."""
    h = beta / n_c * c - beta / n_r * r - gamma
    return -(1 - eps) * log_sigmoid(h) - eps * log_sigmoid(-h)


def orpo_paper(c, r, n_c, n_r, lam, eps):
    """Hong et al. eqs. 2, 4, 6, 7: L_SFT + lambda L_OR, odds(y|x) = P / (1 - P), P = exp(mean log-prob)."""
    p_c, p_r = math.exp(c / n_c), math.exp(r / n_r)
    log_or = math.log((p_c / (1 - p_c)) / (p_r / (1 - p_r)))
    sft = -c / n_c
    return sft + lam * (-(1 - eps) * log_sigmoid(log_or) - eps * log_sigmoid(-log_or))


def rpo_term(c, n_c, alpha):
    return -alpha * c / n_c


@pytest.fixture(scope="module")
def logps():
    rng = np.random.default_rng(0)
    n = 16
    lengths_c = rng.integers(3, 60, n).astype(np.float64)
    lengths_r = rng.integers(3, 60, n).astype(np.float64)
    c = -lengths_c * rng.uniform(0.05, 2.0, n)
    r = -lengths_r * rng.uniform(0.05, 2.0, n)
    return c, r, lengths_c, lengths_r, c + rng.normal(0, 3, n), r + rng.normal(0, 3, n)


@pytest.mark.parametrize("eps", [0.0, 0.1])
@pytest.mark.parametrize("sft_weight", [0.0, 0.5])
def test_dpo_loss_is_the_papers(logps, eps, sft_weight):
    from tunix_pipeline.train.preference import pair_losses

    c, r, nc, nr, c_ref, r_ref = logps
    got, chosen_reward, _ = pair_losses("dpo", c, r, nc, nr, c_ref, r_ref, beta=0.3, label_smoothing=eps,
                                        sft_weight=sft_weight)
    want = [dpo_paper(*x, 0.3, eps) + rpo_term(x[0], n, sft_weight) for x, n in zip(zip(c, r, c_ref, r_ref), nc)]
    np.testing.assert_allclose(np.asarray(got), want, rtol=0, atol=1e-5)
    np.testing.assert_allclose(np.asarray(chosen_reward), 0.3 * (c - c_ref), atol=1e-5)


@pytest.mark.parametrize("eps", [0.0, 0.2])
def test_simpo_loss_is_the_papers(logps, eps):
    from tunix_pipeline.train.preference import pair_losses

    c, r, nc, nr, _, _ = logps
    got, _, _ = pair_losses("simpo", c, r, nc, nr, beta=2.0, simpo_gamma=0.7, label_smoothing=eps)
    want = [simpo_paper(*x, 2.0, 0.7, eps) for x in zip(c, r, nc, nr)]
    np.testing.assert_allclose(np.asarray(got), want, rtol=0, atol=1e-5)


@pytest.mark.parametrize("eps", [0.0, 0.1])
def test_orpo_loss_is_the_papers_on_averaged_log_probs(logps, eps):
    from tunix_pipeline.train.preference import pair_losses

    c, r, nc, nr, _, _ = logps
    got, _, _ = pair_losses("orpo", c, r, nc, nr, orpo_lambda=0.25, label_smoothing=eps)
    want = [orpo_paper(*x, 0.25, eps) for x in zip(c, r, nc, nr)]
    np.testing.assert_allclose(np.asarray(got), want, rtol=0, atol=1e-5)


def test_orpo_odds_ratio_term_differs_from_tunix_summed_one():
    """The issue's example: 40-token answers; Tunix sums log-probs, the paper averages them."""

    from tunix_pipeline.train.preference import pair_losses

    n = 40.0
    c, r = -0.5 * n, -0.9 * n
    paper_term = orpo_paper(c, r, n, n, 1.0, 0.0) - (-c / n)
    got, _, _ = pair_losses("orpo", np.array([c]), np.array([r]), np.array([n]), np.array([n]), orpo_lambda=1.0)
    assert float(got[0]) - (-c / n) == pytest.approx(paper_term, abs=1e-5)
    summed = c - r - (math.log1p(-math.exp(c)) - math.log1p(-math.exp(r)))
    assert abs(-log_sigmoid(summed) - paper_term) > 0.1  # on sums the term is ~1e-7 here: no gradient left


def test_pair_accuracy_counts_ties_half():
    from tunix_pipeline.train.preference import pair_accuracy

    assert float(pair_accuracy(np.array([1.0, 0.0, 2.0, 3.0]), np.array([0.0, 0.0, 3.0, 3.0]))) == pytest.approx(0.5)
    assert float(pair_accuracy(np.array([1.0, 1.0]), np.array([0.0, 0.0]))) == 1.0


# ---------------------------------------------------------------- preference data in
def _write_jsonl(path, rows):
    import json

    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_chat_pairs_share_their_prompt_turns_and_render_like_sft(tmp_path, tokenizer):
    from tunix_pipeline.config import FormatParams, IngestParams, SourceParams
    from tunix_pipeline.data.formatting import format_records
    from tunix_pipeline.data.ingest import ingest

    user = {"role": "user", "content": "What is 2 + 3?"}
    good = {"chosen": [user, {"role": "assistant", "content": "<reasoning>2 + 3 = 5</reasoning><answer>5</answer>"}],
            "rejected": [user, {"role": "assistant", "content": "six"}]}
    rows = [
        good,
        good,  # a duplicate
        {"chosen": good["chosen"], "rejected": [{"role": "user", "content": "other"}, good["rejected"][1]]},
        {"chosen": good["chosen"], "rejected": [user]},
        {"chosen": good["chosen"], "rejected": good["chosen"]},
        {"prompt": "What is 1 + 1?", "chosen": "#### 2", "rejected": "3"},  # the text shape in the same file
    ]
    path = _write_jsonl(tmp_path / "pairs.jsonl", rows)
    train, _, report = ingest(IngestParams(sources=[SourceParams(name="p", path=path, format="preference")],
                                           eval_fraction=0.0))
    stats = report["sources"]["p"]
    assert stats["kept"] == 2 and stats["duplicates"] == 1
    assert stats["dropped"] == {"prompt_mismatch": 1, "no_assistant_turn": 1, "same_answers": 1}
    formatted = format_records(train, tokenizer, FormatParams()).set_index("answer")
    # the same chat template and reasoning format as SFT; text without tags is the answer, reasoning empty
    assert formatted.loc["5", "completion"] == "<reasoning>2 + 3 = 5</reasoning><answer>5</answer><end_of_turn>"
    assert formatted.loc["5", "rejected"] == "<reasoning></reasoning><answer>six</answer><end_of_turn>"
    assert formatted.loc["2", "rejected"] == "<reasoning></reasoning><answer>3</answer><end_of_turn>"
    assert formatted.loc["5", "prompt"].endswith("What is 2 + 3?<end_of_turn>\n<start_of_turn>model\n")


def test_preference_sources_are_not_mixed_with_sft_ones():
    from pydantic import ValidationError

    from tunix_pipeline.config import IngestParams, SourceParams

    with pytest.raises(ValidationError, match="under `preference.data.sources`"):
        IngestParams(sources=[SourceParams(name="a", path="a.jsonl", format="gsm8k"),
                              SourceParams(name="b", path="b.jsonl", format="preference")])


def _formatted_pairs(tokenizer, n=24, long_every=0):
    import pandas as pd

    from tunix_pipeline.data.formatting import gemma_turns

    rows = []
    for i in range(n):
        prompt = gemma_turns([{"role": "user", "content": f"What is {i} + 2?" + (" apples" * 80 if long_every and i % long_every == 0 else "")}],
                             tokenizer.bos_token)
        rows.append({"id": f"r{i}", "prompt": prompt,
                     "completion": f"<reasoning>{i} + 2 = {i + 2}</reasoning><answer>{i + 2}</answer><end_of_turn>",
                     "rejected": "<reasoning></reasoning><answer>I do not know</answer><end_of_turn>"})
    return pd.DataFrame(rows)


def _params(tmp_path, **kw):
    from tunix_pipeline.config import PreferenceParams

    base = dict(enabled=True, method="dpo", max_steps=4, learning_rate=1e-3, beta=0.5, max_prompt_length=48,
                max_response_length=32, per_device_batch_size=1, checkpoint_dir=str(tmp_path / "ck"),
                checkpoint_every=2, from_rewards={"max_new_tokens": 16})
    return PreferenceParams(**{**base, **kw})


def test_pairs_are_left_and_right_padded_and_never_truncated(tmp_path, tokenizer):
    from tunix_pipeline.data.tokenization import encode_batch
    from tunix_pipeline.train import pairs

    formatted = _formatted_pairs(tokenizer, n=12, long_every=5)
    formatted.loc[1, "completion"] = "<reasoning>" + "x " * 40 + "</reasoning><answer>1</answer>"
    formatted.loc[2, "rejected"] = formatted.loc[2, "completion"]
    rows, stats = pairs.tokenize_pairs(formatted, tokenizer, _params(tmp_path))
    assert stats["dropped"] == {"prompt_too_long": 3, "response_too_long": 1, "same_tokens": 1}
    assert len(rows) == stats["pairs_out"] == 7 and "r0" not in set(rows["id"]) and "r1" not in set(rows["id"])
    arrays = pairs.pair_arrays(rows)
    assert arrays["prompt_ids"].shape == (7, 48) and arrays["chosen_ids"].shape == (7, 32)
    kept = formatted.set_index("id").loc[rows["id"]]
    pad = tokenizer.pad_token_id
    for i, (prompt, chosen) in enumerate(zip(kept["prompt"], kept["completion"])):
        p, c = encode_batch(tokenizer, [prompt, chosen])
        assert arrays["prompt_ids"][i, -len(p):].tolist() == p and set(arrays["prompt_ids"][i, : -len(p)]) <= {pad}
        assert arrays["prompt_mask"][i].sum() == len(p) and arrays["prompt_mask"][i, -len(p):].all()
        assert arrays["chosen_ids"][i, : len(c)].tolist() == c and arrays["chosen_mask"][i].sum() == len(c)
        assert c[0] != tokenizer.bos_token_id  # no BOS before an answer (Tunix's string path puts one)


# ---------------------------------------------------------------- training on Tunix's DPOTrainer
def _flat(model, kind):
    from flax import nnx

    return {".".join(map(str, k)): np.asarray(v[...]) for k, v in nnx.to_flat_state(nnx.state(model, kind))}


@pytest.mark.slow
def test_dpo_resumes_and_precomputed_reference_equals_the_reference_model(tmp_path, tiny_model_dir, tokenizer):
    """4 steps with a reference model == 2 steps with precomputed reference log-probs, then 2 more after a resume.

    (A constant learning rate: the first 2-step run's schedule is then the same as the 4-step one's.)
    """
    from tunix_pipeline.config import RuntimeParams
    from tunix_pipeline.models import load_model
    from tunix_pipeline.core.runtime import make_mesh
    from tunix_pipeline.train import pairs, preference

    mesh = make_mesh(RuntimeParams(mesh={"fsdp": 4, "tp": 2}))
    pairs, _ = pairs.tokenize_pairs(_formatted_pairs(tokenizer), tokenizer, _params(tmp_path))
    train, held_out = pairs.iloc[:16], pairs.iloc[16:]
    model, _ = load_model(tiny_model_dir, mesh, "float32")
    batch = preference.check_enough_pairs(len(train), _params(tmp_path), mesh)
    straight = preference.train_preference(model, train, held_out, _params(tmp_path / "a", schedule="constant"), mesh, batch)
    assert straight["reference_model"] and straight["latest_step"] == 4
    assert straight["heldout_pair_accuracy_before"] == 0.5  # policy == reference: every pair a tie
    assert straight["heldout_pair_accuracy"] > 0.5
    assert straight["history"][0]["rewards/accuracy"] == 0.5 and straight["history"][-1]["rewards/margin"] > 0

    params = _params(tmp_path / "b", precompute_reference=True, schedule="constant")
    model, _ = load_model(tiny_model_dir, mesh, "float32")
    first = preference.train_preference(model, train, held_out, params.model_copy(update={"max_steps": 2}), mesh, batch)
    model, _ = load_model(tiny_model_dir, mesh, "float32")
    resumed = preference.train_preference(model, train, held_out, params, mesh, batch)
    assert not first["reference_model"] and first["precomputed_reference"]
    assert (resumed["resumed_from_step"], resumed["latest_step"]) == (2, 4)
    # the same float32 sums reduced in another order: |log p| sums ~1e2 -> ~1e-5 apart, x beta
    got = [h["loss"] for h in resumed["history"]]
    np.testing.assert_allclose(got, [h["loss"] for h in straight["history"]], atol=1e-4)


@pytest.mark.slow
def test_orpo_with_lora_trains_only_the_adapters(tmp_path, tiny_model_dir, tokenizer):
    from flax import nnx

    from tunix_pipeline.config import LoraParams, RuntimeParams
    from tunix_pipeline.models import apply_lora, load_model
    from tunix_pipeline.core.runtime import make_mesh
    from tunix_pipeline.train import pairs, preference

    mesh = make_mesh(RuntimeParams(mesh={"fsdp": 4, "tp": 2}))
    pairs, _ = pairs.tokenize_pairs(_formatted_pairs(tokenizer), tokenizer, _params(tmp_path))
    model, _ = load_model(tiny_model_dir, mesh, "float32")
    model = apply_lora(model, LoraParams(rank=4, alpha=8.0), mesh)
    base, adapters = _flat(model, nnx.Param), _flat(model, nnx.LoRAParam)
    params = _params(tmp_path, method="orpo")
    batch = preference.check_enough_pairs(16, params, mesh)
    result = preference.train_preference(model, pairs.iloc[:16], pairs.iloc[16:], params, mesh, batch)
    assert not result["reference_model"] and result["latest_step"] == 4
    after = _flat(model, nnx.Param)
    assert all(np.array_equal(base[k], after[k]) for k in base if k not in adapters)
    assert any(not np.array_equal(adapters[k], v) for k, v in _flat(model, nnx.LoRAParam).items())


def test_export_ships_the_last_stage_that_ran_from_the_current_checkpoint(caplog):
    from tunix_pipeline.pipelines.export.nodes import final_checkpoint

    sft = {"checkpoint_dir": "/c/sft", "latest_step": 200}
    pref = {"enabled": True, "checkpoint_dir": "/c/pref", "latest_step": 20, "start_checkpoint_dir": "/c/sft",
            "start_step": 200}
    grpo = {"enabled": True, "checkpoint_dir": "/c/grpo/actor", "latest_step": 4, "start_checkpoint_dir": "/c/pref",
            "start_step": 20}
    passed = {"enabled": False, "checkpoint_dir": "/c/pref", "latest_step": 20}
    assert final_checkpoint({"sft": sft, "preference": pref, "grpo": grpo}) == ("grpo", "/c/grpo/actor")  # SFT -> SimPO -> GRPO
    assert final_checkpoint({"sft": sft, "preference": pref, "grpo": passed}) == ("preference", "/c/pref")  # GRPO off
    stale_sft = {"sft": {**sft, "latest_step": 210}, "preference": pref, "grpo": grpo}
    assert final_checkpoint(stale_sft) == ("sft", "/c/sft")  # both stale
    assert "preference_result is from SFT step 200" in caplog.text
    grpo_stale = {"sft": sft, "preference": {**pref, "latest_step": 30}, "grpo": grpo}
    assert final_checkpoint(grpo_stale) == ("preference", "/c/pref")


# ---------------------------------------------------------------- pairs from the model's own samples, and from data
def longest_answer(prompts, completions, **_):
    """A reward that differs between random samples: the length of the text."""
    return [float(len(c)) for c in completions]


def test_pairs_from_rewards_keep_best_and_worst_beyond_the_margin(tmp_path, tiny_model_dir, tokenizer):
    from tunix_pipeline.config import RewardParams, RuntimeParams
    from tunix_pipeline.data.formatting import end_of_turn
    from tunix_pipeline.models import load_model
    from tunix_pipeline.core.runtime import make_mesh
    from tunix_pipeline.train import pairs
    from tunix_pipeline.train.rewards import RewardSet

    mesh = make_mesh(RuntimeParams(mesh={"fsdp": 4, "tp": 2}))
    model, _ = load_model(tiny_model_dir, mesh, "float32")
    formatted = _formatted_pairs(tokenizer, n=6).assign(source="s", answer="2")
    rewards = RewardSet([RewardParams(fn="tests.test_preference:longest_answer")])
    params = _params(tmp_path, from_rewards={"num_samples": 3, "max_new_tokens": 12, "batch_size": 8, "margin": 4.0})
    pairs, counts = pairs.pairs_from_rewards(model, tokenizer, formatted, params, rewards, mesh, max_prompts=5)
    assert counts["prompts"] == 5 and counts["samples"] == 15 and counts["pairs"] + counts["below_margin"] == 5
    assert len(pairs) == counts["pairs"] > 0
    assert (pairs["chosen_reward"] - pairs["rejected_reward"] >= 4.0).all()
    closing = end_of_turn(tokenizer)
    for chosen, rejected, score in zip(pairs["completion"], pairs["rejected"], pairs["chosen_reward"]):
        # the scored text is the sample; one that stopped by itself also carries the end-of-turn marker
        assert len(chosen.removesuffix(closing)) == score and len(chosen) > len(rejected.removesuffix(closing))
    assert set(pairs["id"]) <= set(formatted["id"].head(5))


def test_pairs_from_rewards_name_preferences_own_prompt_limit(tmp_path, tokenizer, caplog):
    from tunix_pipeline.train import pairs

    formatted = _formatted_pairs(tokenizer, n=2, long_every=1).assign(source="s", answer="2")  # every prompt too long
    # no prompt fits: no sampling, so no model, rewards or mesh are needed
    with caplog.at_level("WARNING"):
        out, counts = pairs.pairs_from_rewards(None, tokenizer, formatted, _params(tmp_path), None, None, max_prompts=2)
    assert out.empty and counts["prompts"] == 0 and counts["prompts_too_long"] == 2
    assert "longer than preference.max_prompt_length=48 tokens" in caplog.text and "grpo." not in caplog.text


def test_pairs_from_data_are_ingested_and_formatted_by_the_node(tmp_path, tiny_model_dir):
    import json

    from tunix_pipeline.config import FormatParams, ModelParams, PreferenceParams, RuntimeParams
    from tunix_pipeline.pipelines.preference.nodes import build_pairs

    path = tmp_path / "pairs.csv"
    path.write_text("question,good,bad\nWhat is 1 + 1?,#### 2,3\nWhat is 2 + 2?,<reasoning>2 + 2</reasoning><answer>4</answer>,5\n"
                    "What is 3 + 3?,6,\n")
    params = PreferenceParams(enabled=True, pairs="from_data", data={
        "sources": [{"name": "csv", "path": str(path), "format": "preference",
                     "columns": {"prompt": "question", "chosen": "good", "rejected": "bad"}}],
        "eval_fraction": 0.0})
    train, held_out, report = build_pairs(
        None, None, {"path": str(tiny_model_dir)}, {}, ModelParams(), params, [], FormatParams(),
        RuntimeParams())
    assert sorted(train["answer"]) == ["2", "4"] and len(held_out) == 0
    assert report["data_quality"]["sources"]["csv"]["dropped"] == {"empty_field:bad": 1}
    assert json.dumps(report)  # a JSON dataset
    assert set(train["rejected"]) == {"<reasoning></reasoning><answer>3</answer><end_of_turn>",
                                      "<reasoning></reasoning><answer>5</answer><end_of_turn>"}


# ---------------------------------------------------------------- the plan
def test_plan_holds_a_reference_only_for_dpo_without_precomputed_log_probs():
    import yaml

    from tunix_pipeline.config import (
        LoraParams, ModelParams, PlanParams, PreferenceParams, RuntimeParams, SftParams, TokenizeParams,
    )
    from tunix_pipeline.planning import build_plan
    from tunix_pipeline.planning.preference import add_preference

    from .conftest import ROOT

    plan = PlanParams(**{**yaml.safe_load((ROOT / "conf/base/parameters_plan.yml").read_text())["plan"],
                         "hardware": "kaggle-tpu-v5e-8"})
    sft = SftParams(max_steps=100, per_device_batch_size=4, learning_rate=1e-5, checkpoint_every=50,
                    loss_chunk_size=256, remat="decoder")
    tokenize, runtime = TokenizeParams(max_length=1024), RuntimeParams()

    def stage(model, **kw):
        pref = PreferenceParams(enabled=True, max_prompt_length=256, max_response_length=256,
                                from_rewards={"max_new_tokens": 200}, **kw)
        return add_preference(build_plan(model, sft, runtime, tokenize, plan), pref, plan)

    full = ModelParams(source="google/gemma-2b", dtype="bfloat16")
    dpo, pre, simpo = stage(full), stage(full, precompute_reference=True), stage(full, method="simpo")
    weights_per_chip = 2.5e9 * 2 / 8 / 2**30  # Gemma-2B's bf16 weights over 8 chips
    assert dpo.polish["preference"]["selected"]["reference_gib"] == pytest.approx(weights_per_chip, rel=0.05)
    assert pre.polish["preference"]["reference"] == "precomputed" and pre.polish["preference"]["selected"]["reference_gib"] == 0
    assert simpo.polish["preference"]["reference"] == "none" and simpo.polish["preference"]["selected"]["reference_gib"] == 0
    gap = dpo.polish["preference"]["selected"]["memory_per_device_gib"] - pre.polish["preference"]["selected"]["memory_per_device_gib"]
    assert gap == pytest.approx(dpo.polish["preference"]["selected"]["reference_gib"], abs=1e-3)
    # precomputing costs one forward pass; training without a reference costs less a step than with one
    assert simpo.polish["preference"]["selected"]["step_seconds"] < dpo.polish["preference"]["selected"]["step_seconds"]
    assert dpo.polish["preference"]["selected"]["pair_building_samples"] == (64 + 16) * 4 and dpo.summary()["preference"]  # defaults
    lora = stage(full.model_copy(update={"lora": LoraParams(rank=16)}))
    assert 0 < lora.polish["preference"]["selected"]["reference_gib"] < 0.05  # the SFT adapters; the base is shared
    # too many pairs per chip: a warning that names the fix, the run marked risky
    big = stage(full, per_device_batch_size=48)
    assert not big.polish["preference"]["selected"]["fits"] and big.status in ("risky", "over")
    assert any("the dpo stage needs" in w and "precompute_reference" in w for w in big.warnings)


# ---------------------------------------------------------------- sessions: SFT -> SimPO -> GRPO
def test_sessions_hand_on_the_last_stage_of_the_previous_session(tmp_path):
    from tunix_pipeline.run.sessions import Ledger, apply_current_session

    ledger = Ledger(tmp_path)
    ledger.record_finished(0, "sft_lora", {"checkpoint_dir": str(tmp_path / "06_models/sft/sft_lora"), "step": 600})
    ledger.record_finished(1, "simpo", {
        "checkpoint_dir": str(tmp_path / "06_models/sft/sft_lora"), "step": 600,
        "preference_checkpoint_dir": str(tmp_path / "06_models/pref/simpo"), "preference_step": 100,
    })
    assert ledger.finished("simpo")["preference_checkpoint_dir"] == "06_models/pref/simpo"  # relative to the root
    params = {
        "runtime": {"output_root": str(tmp_path)},
        "sft": {"checkpoint_dir": "ck/sft"}, "grpo": {"checkpoint_dir": "ck/grpo"},
        "preference": {"checkpoint_dir": "ck/pref", "enabled": False},
        "sessions": {"plan": [
            {"name": "sft_lora", "hours": 4},
            {"name": "simpo", "hours": 3, "params": {"sft": {"max_steps": 0}, "preference": {"enabled": True}}},
            {"name": "grpo", "hours": 9, "params": {"sft": {"max_steps": 0}, "grpo": {"enabled": True}}},
        ]},
    }
    current = apply_current_session(params)
    assert current["sessions"]["current"]["name"] == "grpo"
    assert current["sft"]["init_from"] == str(tmp_path / "06_models/pref/simpo")  # SimPO's policy, not SFT's
    assert current["sessions"]["current"]["parent"]["step"] == 100
    assert current["preference"] == {"checkpoint_dir": "ck/pref/grpo", "enabled": False, "time_budget_hours": 9}
    del ledger.data["finished"]["simpo"]
    ledger.save()
    second = apply_current_session(params)  # session 2: SimPO on, with its own folder and the session's hours
    assert second["preference"] == {"checkpoint_dir": "ck/pref/simpo", "enabled": True, "time_budget_hours": 3}
    assert second["sft"]["init_from"] == str(tmp_path / "06_models/sft/sft_lora")


def test_too_few_pairs_stop_before_any_weights_load(tmp_path, tokenizer):
    from tunix_pipeline.config import RuntimeParams
    from tunix_pipeline.core.runtime import make_mesh
    from tunix_pipeline.train import preference
    from tunix_pipeline.train.pairs import why_too_few
    from tunix_pipeline.train.skips import NothingToLearn

    mesh = make_mesh(RuntimeParams(mesh={"fsdp": 4, "tp": 2}))
    params = _params(tmp_path)
    report = {"pairs": "from_rewards", "train": {"prompts": 64, "pairs": 3, "below_margin": 61, "equal_rewards": 58,
                                                 "largest_reward_gap": 0.25}}
    why = why_too_few(report, {"prompt_too_long": 2, "same_tokens": 0}, params)
    with pytest.raises(NothingToLearn, match=r"3 training pairs cannot fill one batch of 4 pairs .*: 61 of 64 prompts' "
                       r"best and worst of 4 samples differ by less than preference.from_rewards.margin=0.5 \(58 scored "
                       r"all equal; the largest difference: 0.25\); tokenizing dropped \{'prompt_too_long': 2") as caught:
        preference.check_enough_pairs(3, params, mesh, why)
    assert "lower preference.from_rewards.margin" in caught.value.fix and caught.value.stage == "preference"
    all_equal = {"pairs": "from_rewards", "train": {"prompts": 64, "pairs": 0, "below_margin": 64, "equal_rewards": 64}}
    assert why_too_few(all_equal, {}, params)[0] == "all 4 samples of each of the 64 prompts scored equal rewards"
    from_data = {"pairs": "from_data", "data_quality": {"totals": {"train_rows": 3}}}
    assert why_too_few(from_data, {}, params) == ("preference.data gave 3 training pairs",
                                                  "add pairs to preference.data, or lower preference.per_device_batch_size")
    assert preference.check_enough_pairs(4, params, mesh) == 4
