"""Settings of the polish after SFT: `grpo` (and its rewards) and `preference` (DPO, ORPO, SimPO; pairs from rewards)."""

from __future__ import annotations

import string
from typing import Literal

from pydantic import Field, model_validator

from tunix_pipeline.config.base import Location, Strict
from tunix_pipeline.config.data import IngestParams
from tunix_pipeline.config.training import CheckpointSettings, DevEvalParams, OptimizerSettings


# the judge's default rubric: the question, the policy's completion and the reference (when the row has one)
DEFAULT_RUBRIC = (
    "You are grading a student's answer.\n\nQuestion:\n{prompt}\n\nReference answer:\n{reference}\n\n"
    "Student's answer:\n{completion}\n\nIs the student's final answer correct and the reasoning sound? "
    "Reply Yes or No."
)


class JudgeParams(Strict):
    """A judge model that scores completions with a rubric: the reward `fn: judge` (`judge.Judge`).

    The rubric is rendered as the judge's user turn (its chat template, else Gemma's turns; or as plain text with
    `chat_template: false`); the score is read
    from its reply: `read: label` weighs the probability of each label word at the reply's first token (one
    forward pass, no generation); `read: number` generates up to `max_new_tokens` greedily and reads the first
    number, within `score_range`. Scores are normalised to [0, 1]; a reply with no usable number, or a rubric
    too long for `max_prompt_length`, scores `malformed_score` and is counted.
    """

    # like model.source: a hub id, a local HF folder, a .gguf file (or a folder holding one), "pypi:<package>",
    # "kaggle:<handle>"
    source: str
    revision: str | None = None
    dtype: Literal["float32", "bfloat16"] = "float32"
    local_dir: str = Field("data/06_models/judge_model", description="where a .gguf or pypi: judge is converted")
    # fields: {prompt} (the question, turn markers removed), {completion}, {reference} ("(none)" when missing)
    rubric: str = DEFAULT_RUBRIC
    # false: the rubric as plain text after the BOS, for a base (not instruction-tuned) judge
    chat_template: bool = True
    read: Literal["label", "number"] = "label"
    # read: label -> the score of each label word (its first token); the score is their probability-weighted mean
    labels: dict[str, float] = {"Yes": 1.0, "No": 0.0}
    # read: number -> the range of the number the rubric asks for, mapped to [0, 1]
    score_range: tuple[float, float] = (0.0, 10.0)
    max_new_tokens: int = Field(8, gt=0, description="read: number -> tokens generated for the score")
    malformed_score: float = Field(0.0, ge=0, le=1)
    batch_size: int = Field(8, gt=0, description="rubrics scored per compiled call (padded to it)")
    max_prompt_length: int = Field(1024, gt=0, description="tokens of the rendered rubric; longer ones are malformed")
    # null: time-shared with the policy on its devices; N: the judge's own sub-mesh of the last N devices
    devices: int | None = Field(None, gt=0)

    @model_validator(mode="after")
    def _consistent(self):
        low, high = self.score_range
        if high <= low:
            raise ValueError(f"score_range {list(self.score_range)} must rise: [lowest, highest]")
        if self.read == "label" and len(self.labels) < 2:
            raise ValueError("read: label needs at least two `labels` (e.g. {Yes: 1.0, No: 0.0})")
        if self.read == "label" and not all(0 <= v <= 1 for v in self.labels.values()):
            raise ValueError(f"label scores must lie in [0, 1], got {self.labels}")
        unknown = {f for _, f, _, _ in string.Formatter().parse(self.rubric) if f} - {"prompt", "completion", "reference"}
        if unknown:
            raise ValueError(f"rubric fields {sorted(unknown)} are unknown: use {{prompt}}, {{completion}}, {{reference}}")
        if "{completion}" not in self.rubric:
            raise ValueError("the rubric must show the judge the {completion}")
        return self


class RewardParams(Strict):
    """One GRPO reward: a built-in name, `package.module:function`, or `judge` (with `judge:` settings), weighted in
    the total."""

    # built-in: format_exact, format_approx, answer, length_penalty, judge;
    # custom: "package.module:function" with signature (prompts, completions, **columns) -> list[float]
    fn: str
    weight: float = 1.0
    name: str | None = Field(None, description="label in metrics; default: the function's name")
    kwargs: dict = Field({}, description="extra keyword arguments for the function")
    judge: JudgeParams | None = Field(None, description="fn: judge -> the judge model, rubric and how to read it")

    @model_validator(mode="after")
    def _judge_settings(self):
        if (self.fn == "judge") != (self.judge is not None):
            raise ValueError("`fn: judge` and `judge:` settings go together" if self.fn == "judge"
                             else f"`judge:` settings are for `fn: judge`, not {self.fn!r}")
        return self


class PromptFilterParams(Strict):
    """Before GRPO's first step, the starting policy samples each pool prompt `samples` times as the rollouts do, and
    GRPO trains only on the prompts it gets right in some samples and not all, by `reward`: a group whose samples
    are all right or all wrong has no advantage to learn from (DAPO's dynamic sampling, done once up front)."""

    samples: int = Field(8, ge=2, description="samples a prompt (more find more prompts the policy solves sometimes)")
    reward: str = Field("answer", description="the name of the grpo.rewards entry that decides")
    # `answer` gives near misses partial credit: at 1.0 only a right answer counts
    right_at: float | None = Field(1.0, description="a sample is right at this score or more; null: kept whenever "
                                                    "the samples' scores differ at all (partial credit included)")
    batch_size: int = Field(32, gt=0, description="rows generated at a time")


class GrpoParams(OptimizerSettings, CheckpointSettings):
    """GRPO polish from the SFT checkpoint with Tunix's RLCluster + GRPOLearner (vanilla rollout)."""

    enabled: bool = False
    strict: bool = Field(False, description="fail the run, instead of skipping the stage, when it has nothing to learn from")
    loss_variant: Literal["grpo", "dr-grpo", "dapo"] = "grpo"
    max_steps: int = Field(gt=0)
    batch_size: int = Field(2, gt=0, description="prompts per step (x num_generations completions)")
    # a small fixed pool seen in epochs: later steps revisit earlier prompts, so the reward's trend
    # is the policy's and not which prompts a step drew
    max_prompts: int | None = Field(None, gt=0, description="train on a seeded sample of this many prompts; null: all")
    num_generations: int = Field(4, ge=2, description="completions per prompt (G)")
    # Tunix's micro-batches: generation, log-probs and gradient accumulation over this many prompts at
    # a time, one optimizer update per step, so memory follows the micro-batch, not the group size
    micro_batch_size: int | None = Field(
        None, gt=0, description="prompts per micro-batch (x num_generations completions); null: the whole batch"
    )
    num_iterations: int = Field(1, ge=1, description="policy updates per batch of rollouts (mu)")
    beta: float = Field(0.04, ge=0, description="KL weight to the frozen SFT reference; 0: no reference model")
    epsilon: float = Field(0.2, gt=0, description="clipping epsilon")
    epsilon_high: float | None = Field(None, gt=0, description="dapo only: upper clip (default 0.28)")
    max_prompt_length: int = Field(256, gt=0, description="longer prompts are skipped and counted")
    max_completion_length: int = Field(256, gt=0)
    temperature: float = Field(0.9, gt=0)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int | None = Field(None, gt=0)
    learning_rate: float = Field(1e-5, gt=0)
    checkpoint_dir: Location = "data/06_models/grpo_checkpoints"
    # as sft.dev_eval: score the dev split every N steps, keep and hand on the best step; null: the latest
    dev_eval: DevEvalParams | None = None
    # null: every pool prompt; on: only those the starting policy solves some of the time (`PromptFilterParams`)
    prompt_filter: PromptFilterParams | None = None
    seed: int = 0
    rewards: list[RewardParams] = Field(
        [
            RewardParams(fn="format_exact", weight=1.0),
            RewardParams(fn="format_approx", weight=0.5),
            RewardParams(fn="answer", weight=2.0, kwargs={"tolerance": 1e-6}),
        ],
        min_length=1,
    )

    @model_validator(mode="after")
    def _consistent(self):
        if self.warmup_steps >= self.max_steps:
            raise ValueError(f"warmup_steps ({self.warmup_steps}) must be smaller than max_steps ({self.max_steps})")
        if self.max_prompts is not None and self.max_prompts < self.batch_size:
            raise ValueError(f"max_prompts ({self.max_prompts}) cannot fill one batch of batch_size ({self.batch_size})")
        if self.micro_batch_size is not None and self.batch_size % self.micro_batch_size:
            raise ValueError(
                f"micro_batch_size ({self.micro_batch_size}) must divide batch_size ({self.batch_size}): "
                "use a divisor of it, or null for the whole batch at once"
            )
        if self.epsilon_high is not None and self.loss_variant != "dapo":
            raise ValueError("epsilon_high is a dapo setting; set loss_variant: dapo or remove it")
        if self.loss_variant == "dapo" and self.beta != 0:
            raise ValueError("dapo has no KL term: set beta: 0")
        names = [r.name or r.fn.rsplit(":", 1)[-1] for r in self.rewards]
        if len(set(names)) != len(names):
            raise ValueError(f"reward names must be unique (set `name:`), got {names}")
        if self.prompt_filter is not None and self.prompt_filter.reward not in names:
            raise ValueError(f"prompt_filter.reward {self.prompt_filter.reward!r} names none of the rewards {names}")
        return self


class PairsFromRewardsParams(Strict):
    """`pairs: from_rewards`: k samples per training prompt from the SFT model, scored with GRPO's rewards."""

    max_prompts: int = Field(64, gt=0, description="training prompts to sample for (generation-bound: cap it)")
    eval_prompts: int = Field(16, ge=0, description="eval-split prompts to build held-out pairs from")
    num_samples: int = Field(4, ge=2, description="completions per prompt (k)")
    temperature: float = Field(1.0, gt=0)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, gt=0)
    max_new_tokens: int = Field(256, gt=0)
    batch_size: int = Field(8, gt=0, description="sequences per generation call")
    margin: float = Field(0.5, ge=0, description="keep best/worst only where their total rewards differ by this")
    seed: int = 0
    # null: grpo.rewards (the same functions and weights GRPO optimises)
    rewards: list[RewardParams] | None = None


class PreferenceParams(OptimizerSettings, CheckpointSettings):
    """Preference polish after SFT (and before GRPO) on Tunix's DPOTrainer: DPO, ORPO or SimPO."""

    enabled: bool = False
    strict: bool = Field(False, description="fail the run, instead of skipping the stage, when it has nothing to learn from")
    method: Literal["dpo", "orpo", "simpo"] = "dpo"
    # from_data: `data.sources` in format `preference`; from_rewards: sampled from the SFT model
    pairs: Literal["from_data", "from_rewards"] = "from_rewards"
    data: IngestParams | None = None
    from_rewards: PairsFromRewardsParams = PairsFromRewardsParams()
    beta: float = Field(0.1, gt=0, description="dpo: KL strength; simpo: reward scale; orpo: unused")
    label_smoothing: float = Field(0.0, ge=0, lt=0.5, description="conservative DPO / robust labels (all three)")
    orpo_lambda: float = Field(0.1, gt=0, description="orpo: weight of the odds-ratio term")
    simpo_gamma: float = Field(0.5, ge=0, description="simpo: target reward margin (gamma, as in the paper)")
    # RPO: + sft_weight x NLL of the chosen answer (per-token mean); orpo has its own SFT term
    sft_weight: float = Field(0.0, ge=0)
    # dpo: the reference log-probabilities in one pass before training, so no reference model is held
    precompute_reference: bool = False
    max_prompt_length: int = Field(256, gt=0, description="tokens, left-padded; longer pairs are dropped and counted")
    max_response_length: int = Field(320, gt=0, description="tokens, right-padded; longer pairs are dropped and counted")
    per_device_batch_size: int = Field(2, gt=0, description="pairs per data-parallel device")
    max_steps: int = Field(20, gt=0)
    learning_rate: float = Field(5e-6, gt=0)
    checkpoint_dir: Location = "data/06_models/preference_checkpoints"
    keep_checkpoints: int = Field(2, gt=0)
    time_budget_hours: float | None = Field(None, gt=0)
    seed: int = 0

    @model_validator(mode="after")
    def _consistent(self):
        if self.warmup_steps >= self.max_steps:
            raise ValueError(f"warmup_steps ({self.warmup_steps}) must be smaller than max_steps ({self.max_steps})")
        if self.pairs == "from_data" and self.data is None:
            raise ValueError("pairs: from_data needs `preference.data.sources` (format: preference)")
        if self.data is not None:
            formats = {s.format for s in self.data.sources}
            if formats != {"preference"}:
                raise ValueError(f"preference.data.sources must all have format: preference, got {sorted(formats)}")
        if self.method == "orpo" and self.sft_weight:
            raise ValueError("orpo has its own SFT term (weight 1): set sft_weight: 0, or use dpo/simpo with sft_weight")
        if self.pairs == "from_rewards" and self.from_rewards.max_new_tokens >= self.max_response_length:
            raise ValueError(
                f"from_rewards.max_new_tokens ({self.from_rewards.max_new_tokens}) must be below max_response_length "
                f"({self.max_response_length}): a sample and its end-of-turn must fit, or every pair is dropped"
            )
        if self.precompute_reference and self.method != "dpo":
            raise ValueError(f"precompute_reference is for dpo; {self.method} has no reference model")
        return self
