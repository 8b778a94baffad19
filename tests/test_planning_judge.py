"""A judge reward in GRPO's plan: its memory per device and time per step against a hand computation, time-shared
or on its own sub-mesh, layouts that cannot run refused with what to change, and its scoring call compiled by
XLA:TPU for a Kaggle v5e-8 (libtpu's compile-only devices, no TPU)."""

import pytest
import yaml

from tunix_pipeline.config import GrpoParams, LoraParams, ModelParams, PlanParams, RuntimeParams, TokenizeParams
from tunix_pipeline.planning import DoesNotFit, PlanError, build_plan, markdown
from tunix_pipeline.planning.grpo import add_grpo
from tunix_pipeline.planning.memory import GIB

from .conftest import ROOT
from .test_planning_grpo import CHIP_FLOPS, PLAN, SFT, N

POLICY = ModelParams(source="google/gemma-2b", dtype="bfloat16", lora=LoraParams(rank=16))
MFU = PLAN.profiles["kaggle-tpu-v5e-8"].mfu


def _plan(plan=PLAN, model=POLICY, **judge):
    settings = {"source": "google/gemma-2b-it", "dtype": "bfloat16", "batch_size": 16, "max_prompt_length": 1024,
                **judge}
    grpo = GrpoParams(enabled=True, max_steps=100, batch_size=4, num_generations=8, micro_batch_size=2,
                      max_prompt_length=128, max_completion_length=256, checkpoint_every=50,
                      rewards=[{"fn": "answer", "weight": 2.0}, {"fn": "judge", "judge": settings}])
    return add_grpo(build_plan(model, SFT, RuntimeParams(), TokenizeParams(max_length=512), plan), grpo, plan, 9)


def _without_judge():
    grpo = GrpoParams(enabled=True, max_steps=100, batch_size=4, num_generations=8, micro_batch_size=2,
                      max_prompt_length=128, max_completion_length=256, checkpoint_every=50)
    return add_grpo(build_plan(POLICY, SFT, RuntimeParams(), TokenizeParams(max_length=512), PLAN), grpo, PLAN, 9)


def test_a_judge_on_its_own_chips_leaves_the_policy_the_others_and_adds_its_scoring_to_the_step():
    g = _plan(devices=4).polish["grpo"]["selected"]
    j = g["judge"]
    (d,) = j["judges"]
    assert (j["sub_mesh_devices"], j["policy_devices"], d["layout"], d["devices"]) == (4, 4, "sub-mesh", 4)
    # the policy decodes the 32 completions on its 4 chips (8 a chip, 4 on 8 chips without the judge)
    assert g["sequences_per_device"] == 8 and _without_judge().polish["grpo"]["selected"]["sequences_per_device"] == 4
    # the judge: Gemma-2B's bf16 weights over its 4 chips; one call of 16 rubrics, 4 a chip, of 1,024 tokens
    assert d["weights_gib"] == pytest.approx(2 * N / 4 / GIB, abs=1e-3)
    assert (d["sequences_per_device"], d["positions"], d["kv_cache_gib"]) == (4, 1024, 0)  # read: label, no cache
    assert d["logits_gib"] == round(4 * 256_000 * 4 / GIB, 3)  # the last position's float32 logits only
    assert d["weights_gib"] < d["scoring_gib"] == j["sub_mesh_gib"] < g["usable_memory_gib"]
    # time: the step's 32 completions in 2 calls of 16, their prefill at the profile's MFU on the judge's 4 chips
    prefill = 2 * 2 * N * 16 * 1024 / (4 * CHIP_FLOPS * MFU)
    assert d["calls"] == 2 and d["seconds"] == pytest.approx(prefill, rel=1e-9) == j["seconds"]
    assert g["step_seconds"] == pytest.approx(g["generation_seconds"] + g["update_seconds"] + prefill, rel=1e-9)


def test_a_time_shared_judge_holds_its_weights_beside_both_phases_and_scores_between_them():
    plan = _plan(devices=None)
    g, alone = plan.polish["grpo"]["selected"], _without_judge().polish["grpo"]["selected"]
    (d,) = g["judge"]["judges"]
    weights = 2 * N / 8  # fsdp-sharded over the policy's 8 chips
    assert d["layout"] == "time-shared" and d["devices"] == 8 and g["judge"]["sub_mesh_gib"] is None
    assert d["weights_gib"] == pytest.approx(weights / GIB, abs=1e-3)
    for phase in ("generation", "update"):
        assert g[f"{phase}_gib"] - alone[f"{phase}_gib"] == pytest.approx(weights / GIB, abs=2e-3)
    assert g["judge"]["shared_scoring_gib"] > d["scoring_gib"]  # the policy's resident state beside the call
    prefill = 2 * 2 * N * 16 * 1024 / (8 * CHIP_FLOPS * MFU)
    assert g["step_seconds"] == pytest.approx(alone["step_seconds"] + prefill, rel=1e-9)
    assert "judge `judge`: google/gemma-2b-it" in markdown(plan) and "time-shared on 8 devices" in markdown(plan)


def test_read_number_adds_the_cache_and_the_decode_steps():
    label, number = (_plan(devices=4, read=r, max_new_tokens=8).polish["grpo"]["selected"]["judge"]["judges"][0]
                     for r in ("label", "number"))
    assert number["positions"] == 1024 + 8 and number["kv_cache_gib"] > 0 and number["scoring_gib"] > label["scoring_gib"]
    step = number["decode_step"]
    assert step["from"] == "estimate" and number["decode_seconds"] == pytest.approx(2 * 8 * step["seconds"], rel=1e-9)
    assert number["seconds"] == pytest.approx(label["seconds"] + number["decode_seconds"], rel=1e-6)


def test_a_judge_layout_that_cannot_run_fails_the_plan_saying_what_to_change():
    with pytest.raises(PlanError, match=r"judge.devices: 8 leaves the policy none of kaggle-tpu-v5e-8's 8 devices: "
                                        r"give the judge fewer \(at most 7\), or devices: null"):
        _plan(devices=8)
    # 32 completions (micro-batches of 16) over the 5 chips 3 leave: they do not divide
    with pytest.raises(PlanError, match=r"\(32, micro-batches of 16\) does not divide the 5 devices judge.devices: 3 "
                                        r"leaves the policy: use judge.devices: 4 or 6 or 7"):
        _plan(devices=3)
    with pytest.raises(DoesNotFit, match=r"GRPO's judge does not fit kaggle-tpu-v5e-8: .* per device on its 4 devices"
                                         r".*lower judge.batch_size or max_prompt_length.*more judge.devices"):
        _plan(devices=4, batch_size=256, max_prompt_length=4096)
    with pytest.raises(DoesNotFit, match=r"time-shared.*give it its own devices \(judge.devices: N\)"):
        _plan(devices=None, batch_size=512, max_prompt_length=4096)
    # on other profiles the same layout is a row that does not fit, not an error
    g = _plan(devices=4).polish["grpo"]["profiles"]
    assert not g["tpu-v4-8"]["fits"] and "leaves the policy none" in g["tpu-v4-8"]["judge"]["problem"]


@pytest.mark.slow
def test_the_judges_scoring_call_compiles_for_a_kaggle_v5e_8():
    """The judge recipe's scoring call on its 4 chips, compiled by XLA:TPU; the judge is gemma-3-4b-it's shape at
    2 of its 34 layers (the whole judge, extrapolated from 2 and 3 layers, takes ~80 s here)."""
    from tunix_pipeline.planning import grpo_xla

    recipe = yaml.safe_load((ROOT / "conf/kaggle_gemma3_1b_judge_v5e8/parameters.yml").read_text())
    base = yaml.safe_load((ROOT / "conf/base/parameters_plan.yml").read_text())["plan"]
    archs = recipe["plan"]["architectures"]
    judge_hf = {**archs["google/gemma-3-4b-it"], "num_hidden_layers": 2}
    policy_hf = {**archs["google/gemma-3-1b-it"], "num_hidden_layers": 2}
    params = PlanParams(**{**base, "hardware": "kaggle-tpu-v5e-8", "architectures": {"judge-2": judge_hf,
                                                                                   "policy-2": policy_hf}})
    rewards = [r for r in recipe["grpo"]["rewards"] if r["fn"] != "judge"]
    judge = next(r for r in recipe["grpo"]["rewards"] if r["fn"] == "judge")
    grpo = GrpoParams(**{**recipe["grpo"], "enabled": True,
                         "rewards": rewards + [{**judge, "judge": {**judge["judge"], "source": "judge-2"}}]})
    model = ModelParams(source="policy-2", dtype="bfloat16", lora=LoraParams(**recipe["model"]["lora"]))
    plan = build_plan(model, SFT, RuntimeParams(), TokenizeParams(max_length=512), params)
    from tunix_pipeline.planning import judge as judge_lib
    from tunix_pipeline.planning import xla

    policy, _ = judge_lib.policy_row(plan, plan.selected, grpo, params)
    name, devices = xla.tpu_target(plan.selected.hw)
    x = grpo_xla.check_judges(plan, policy, grpo, judge_lib.architectures(grpo, params), devices, 4)["judge"]
    assert "error" not in x and x["method"].startswith("compiled all 2 layers") and 0 < x["xla_gib"] < 16
    # the head on the last position only: a forward's FLOPs, 2 a weight and token (the embedding is a lookup)
    arch = judge_lib.architectures(grpo, params)["judge"]
    matmuls = 2 * (arch.num_layers * arch.layer_matrix_params) * 16 * 1024 / 4
    assert 1.0 < x["flops_per_device"] / matmuls < 1.5
    print(f"judge call (2 layers): XLA:TPU {x['xla_gib']:.2f} GiB per chip, estimate {x['difference']:+.0%}, "
          f"{x['flops_per_device'] / 1e12:.2f} TFLOP, {x['seconds']:.0f} s")
    # the plan rests on it
    g = add_grpo(plan, grpo, params, 9, {"judges": {"judge": x}}).polish["grpo"]["selected"]["judge"]["judges"][0]
    assert g["memory_from"] == g["flops_from"] == "XLA:TPU" and g["scoring_gib"] == round(x["xla_gib"], 3)
