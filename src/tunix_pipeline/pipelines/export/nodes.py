import logging

from tunix_pipeline.config import ExportParams, ModelParams, RuntimeParams
from tunix_pipeline.models import export_pretrained, load_run_model, load_tokenizer
from tunix_pipeline.training import make_mesh, restore_latest

log = logging.getLogger(__name__)


def final_checkpoint(sft_result: dict, grpo_result: dict) -> tuple[str, str]:
    """(stage, checkpoint dir) of the policy to ship: GRPO's when it ran from the current SFT checkpoint, else SFT's."""
    if grpo_result.get("enabled"):
        if (grpo_result.get("sft_checkpoint_dir"), grpo_result.get("sft_step")) == (
            sft_result["checkpoint_dir"], sft_result["latest_step"]
        ):
            return "grpo", grpo_result["checkpoint_dir"]
        log.warning(
            "export: grpo_result is from SFT step %s in %s, not the current %s in %s; exporting the SFT checkpoint "
            "(run the `grpo` pipeline first to export its policy)",
            grpo_result.get("sft_step"), grpo_result.get("sft_checkpoint_dir"),
            sft_result["latest_step"], sft_result["checkpoint_dir"],
        )
    return "sft", sft_result["checkpoint_dir"]


def export_model(
    base_model: dict, sft_result: dict, grpo_result: dict, model: ModelParams, params: ExportParams, runtime: RuntimeParams
) -> dict:
    """The latest checkpoint (GRPO's when it ran, else SFT's), LoRA merged, as a Hugging Face folder."""
    network, _ = load_run_model(base_model["path"], model, make_mesh(runtime), quantize=False)
    stage, checkpoint_dir = final_checkpoint(sft_result, grpo_result)
    step = restore_latest(network, checkpoint_dir)
    if step == 0:
        raise ValueError(f"export: no {stage} checkpoint in {checkpoint_dir}; run the `{stage}` pipeline first")
    folder = export_pretrained(
        network,
        params.output_dir,
        load_tokenizer(base_model["path"]),
        lora_alpha=model.lora.alpha if model.lora else None,
        max_shard_size=params.max_shard_size,
    )
    return {"path": str(folder), "stage": stage, "checkpoint_step": step, "merged_lora": model.lora is not None}
