import contextlib
import logging

from tunix_pipeline.checkpoints import params_dir, restore_required
from tunix_pipeline.config import ExportParams, FormatParams, ModelParams, RuntimeParams
from tunix_pipeline.models import export_pretrained, load_run_model, load_tokenizer
from tunix_pipeline.models.gguf_export import tuned_chat_template
from tunix_pipeline.paths import local_folder, storage_path
from tunix_pipeline.runtime import make_mesh

log = logging.getLogger(__name__)


STAGE_NAMES = {"sft": "SFT", "preference": "preference", "grpo": "GRPO"}


def final_checkpoint(sft_result: dict, grpo_result: dict, preference_result: dict | None = None) -> tuple[str, str]:
    """(stage, checkpoint dir) of the policy to ship: the last stage of SFT -> preference -> GRPO that ran from the
    current checkpoint of the stage before it (a stage left over from an earlier SFT run is not shipped)."""
    stage, current = "sft", (sft_result["checkpoint_dir"], sft_result["latest_step"])
    for name, result in (("preference", preference_result or {}), ("grpo", grpo_result)):
        start = (result.get("sft_checkpoint_dir"), result.get("sft_step"))
        if not result.get("enabled"):
            continue
        if start == current:
            stage, current = name, (result["checkpoint_dir"], result.get("latest_step"))
            continue
        log.warning(
            "export: %s_result is from %s step %s in %s, not the current %s in %s; exporting the %s checkpoint "
            "(run the `%s` pipeline first to export its policy)", name, STAGE_NAMES[stage], start[1], start[0],
            current[1], current[0], STAGE_NAMES[stage], name,
        )
    return stage, current[0]


def export_model(
    base_model: dict,
    sft_result: dict,
    preference_result: dict,
    grpo_result: dict,
    model: ModelParams,
    params: ExportParams,
    runtime: RuntimeParams,
    format_params: FormatParams,
) -> dict:
    """The latest checkpoint (GRPO's or the preference stage's when they ran, else SFT's), LoRA merged, as a Hugging Face folder; with
    `formats: [hf, gguf]` also as GGUF files and an Ollama Modelfile (with the chat template it was tuned with)."""
    network, _ = load_run_model(base_model["path"], model, make_mesh(runtime), quantize=False)
    stage, checkpoint_dir = final_checkpoint(sft_result, grpo_result, preference_result)
    step = restore_required(network, checkpoint_dir, stage, "export")
    tokenizer = load_tokenizer(base_model["path"])
    gguf = "gguf" in params.formats
    with (
        local_folder(params.output_dir, "export.output_dir") as out_dir,  # a URI: written here, then copied there
        local_folder(params.gguf_dir, "export.gguf_dir") if gguf else contextlib.nullcontext() as gguf_dir,
    ):
        export_pretrained(
            network,
            out_dir,
            tokenizer,
            lora_alpha=model.lora.alpha if model.lora else None,
            max_shard_size=params.max_shard_size,
            gguf_dir=gguf_dir,
            gguf_types=params.gguf_types,
            chat_template=tuned_chat_template(tokenizer, format_params.chat_template) if gguf else None,
        )
    result = {
        "path": str(storage_path(params.output_dir)), "stage": stage, "checkpoint_step": step,
        "merged_lora": model.lora is not None,
        "checkpoint": str(params_dir(checkpoint_dir, step)),  # the final Orbax checkpoint, for Tunix's own code
    }
    skipped = {name: r["skip_reason"] for name, r in (("preference", preference_result), ("grpo", grpo_result))
               if (r or {}).get("skipped")}
    if skipped:  # the polish stages that had nothing to learn from: the export is their parent's policy
        result["skipped_stages"] = skipped
    if gguf:
        result["gguf_dir"] = str(storage_path(params.gguf_dir))
    return result
