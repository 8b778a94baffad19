from tunix_pipeline.config import ExportParams, ModelParams, RuntimeParams
from tunix_pipeline.models import export_pretrained, load_run_model, load_tokenizer
from tunix_pipeline.training import make_mesh, restore_latest


def export_model(
    base_model: dict, sft_result: dict, model: ModelParams, params: ExportParams, runtime: RuntimeParams
) -> dict:
    """The latest SFT checkpoint, LoRA merged, as a Hugging Face folder that transformers loads."""
    network, _ = load_run_model(base_model["path"], model, make_mesh(runtime), quantize=False)
    step = restore_latest(network, sft_result["checkpoint_dir"])
    if step == 0:
        raise ValueError(f"export: no SFT checkpoint in {sft_result['checkpoint_dir']}; run the `sft` pipeline first")
    folder = export_pretrained(
        network,
        params.output_dir,
        load_tokenizer(base_model["path"]),
        lora_alpha=model.lora.alpha if model.lora else None,
        max_shard_size=params.max_shard_size,
    )
    return {"path": str(folder), "checkpoint_step": step, "merged_lora": model.lora is not None}
