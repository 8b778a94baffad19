import contextlib
import logging

from tunix_pipeline.config import ExportParams, FormatParams, ModelParams, RuntimeParams
from tunix_pipeline.core.paths import local_folder, storage_path
from tunix_pipeline.core.runtime import make_mesh
from tunix_pipeline.models import export_pretrained, load_run_model, load_tokenizer
from tunix_pipeline.models.gguf_export import tuned_chat_template
from tunix_pipeline.stages import POLISH, SFT, STAGES, policy_step, selected_step
from tunix_pipeline.train.checkpoints import params_dir, restore_required

log = logging.getLogger(__name__)


def final_checkpoint(results: dict[str, dict]) -> tuple[str, str]:
    """(stage, checkpoint dir) of the policy to ship, from {stage name: its result}: the last stage of the chain
    that trained from the current policy of the stages before it (a result left over from an earlier run of an
    earlier stage is not shipped). Its step is the one the stage hands on (`stages.policy_step`)."""
    stage, current = SFT, (results[SFT.name]["checkpoint_dir"], policy_step(results[SFT.name]))
    for polish in POLISH:
        result = results.get(polish.name) or {}
        if not result.get("enabled"):
            continue
        start = (result.get("start_checkpoint_dir"), result.get("start_step"))
        if start == current:
            stage, current = polish, (result["checkpoint_dir"], policy_step(result))
            continue
        log.warning(
            "export: %s is from %s step %s in %s, not the current %s in %s; exporting the %s checkpoint "
            "(run the `%s` pipeline first to export its policy)", polish.result, stage.title, start[1], start[0],
            current[1], current[0], stage.title, polish.name,
        )
    return stage.name, current[0]


def export_model(
    base_model: dict,
    model: ModelParams,
    params: ExportParams,
    runtime: RuntimeParams,
    format_params: FormatParams,
    **stage_results: dict,
) -> dict:
    """The last trained policy (`final_checkpoint` of `stage_results`, {"<stage>_result": ...}), LoRA merged, as a
    Hugging Face folder; with `formats: [hf, gguf]` also as GGUF files and an Ollama Modelfile (with the chat
    template it was tuned with)."""
    results = {stage.name: stage_results.get(stage.result) for stage in STAGES}
    network, _ = load_run_model(base_model["path"], model, make_mesh(runtime), quantize=False)
    stage, checkpoint = final_checkpoint(results)
    checkpoint_dir = storage_path(checkpoint)
    # the stage's dev-selected step (`dev_eval`), else its latest
    step = restore_required(network, checkpoint_dir, stage, "export", selected_step(results[stage]))
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
            dtype=params.dtype,
        )
    result = {
        "path": str(storage_path(params.output_dir)), "stage": stage, "checkpoint_step": step,
        "merged_lora": model.lora is not None,
        "checkpoint": str(params_dir(checkpoint_dir, step)),  # the final Orbax checkpoint, for Tunix's own code
    }
    skipped = {name: r["skip_reason"] for name, r in results.items() if (r or {}).get("skipped")}
    if skipped:  # the polish stages that had nothing to learn from: the export is their parent's policy
        result["skipped_stages"] = skipped
    if gguf:
        result["gguf_dir"] = str(storage_path(params.gguf_dir))
    return result
