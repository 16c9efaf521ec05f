"""The `trainer:` section of a turnrl config: the run and its mode (RL or SFT), its data, the
rollouts it asks for, the RL algorithm, the SFT batches, the optimizer and where the other
services are.

Longer than our modules should be (~900 lines), on purpose: it is the schema of one config
section, each class a sub-section with its fields, defaults, descriptions and checks, and one
file is where a reader looks up any `trainer.` key (as torchtitan keeps its whole config in
`job_config.py`). The code that acts on a setting lives with that feature, not here."""

import math
import re
from pathlib import Path
from typing import Any, Literal, Self

from pydantic import Field, field_validator, model_validator

from turnrl.calculator_data import ProblemSettings
from turnrl.config import (
    DEFAULT_PORTS,
    ClientConfig,
    ServerConfig,
    StrictModel,
    rubric_placeholders,
)

RUNS_FOLDER = Path("runs")  # the default trainer.output_dir, and so the default runs root
# In a run's folder, the launcher's copy of each service's output (`turnrl run`), written
# before the trainer starts the run: a folder holding only it is a new run's.
RUN_LOGS_FOLDER = "logs"
# A Hub repo id: owner/name, each of letters, digits, '-', '_' and '.', not starting with those.
REPO_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*")


class TrainSettings(StrictModel):
    """Optimiser, schedule, precision and memory settings of one trained model: the policy's
    trainer.optim, or the critic's trainer.critic.optim."""

    learning_rate: float = Field(1e-5, gt=0, description="Peak AdamW learning rate, per step.")
    weight_decay: float = Field(0.0, ge=0, description="AdamW decoupled weight decay, per step.")
    betas: tuple[float, float] = Field((0.9, 0.999), description="AdamW moment decay rates.")
    warmup_steps: int = Field(0, ge=0, description="Optimizer steps of linear warm-up to the peak.")
    lr_schedule: Literal["constant", "cosine"] = Field(
        "constant", description="Learning rate after warm-up: constant, or cosine decay."
    )
    min_lr_ratio: float = Field(
        0.1, ge=0, le=1, description="Cosine: final learning rate as a fraction of the peak."
    )
    total_steps: int = Field(
        0,
        ge=0,
        description="Cosine: optimizer steps until the learning rate reaches its minimum. 0: "
        "the trainer service sets it from trainer.steps x ppo_epochs x mini_batches.",
    )
    grad_clip: float = Field(
        1.0, gt=0, description="Largest global L2 norm of the gradients; .inf only measures it."
    )
    dtype: Literal["float32", "bfloat16"] = Field(
        "float32",
        description="Compute dtype. bfloat16 runs forward and backward in bf16 (FSDP2's "
        "mixed precision; autocast in a single process) and reduces gradients in fp32; "
        "weights, logprobs and optimizer state stay fp32 either way.",
    )
    activation_checkpointing: bool = Field(
        False, description="Recompute each decoder layer in the backward pass to save memory."
    )
    micro_batch_tokens: int = Field(
        4096,
        gt=0,
        description="Token budget of one micro-batch: rows x its longest row; packed "
        "(pack_sequences), its rows' tokens; with shared_prefix_forward, the tokens of its "
        "three forwards, padding included (each: its prefixes or rows x the most tokens one "
        "of them computes).",
    )
    pack_sequences: bool = Field(
        False,
        description="Forward each micro-batch's rows as one sequence without padding, each "
        "attending within itself (positions restarted per row, from which transformers "
        "builds a block-diagonal causal mask): no compute or logits for "
        "padding, the same logprobs to 1e-5. Where shared_prefix_forward applies (a policy "
        "step's groups) that forward is used instead; images' rows stay padded.",
    )
    shared_prefix_forward: bool = Field(
        True,
        description="The policy's forward passes compute the prefix that all the prompts "
        "share (a system prompt) once, then each group's prompt once, then each sample's own "
        "tokens, each on the KV of the one before: the same logprobs and gradients with far "
        "fewer tokens computed. Off, or for a model with sliding-window or linear attention "
        "layers: one forward over whole rows.",
    )

    def for_run(self, optimizer_steps: int) -> "TrainSettings":
        """These settings for a run of `optimizer_steps` steps: a cosine schedule whose
        `total_steps` is 0 decays over them."""
        if self.lr_schedule != "cosine" or self.total_steps > 0:
            return self
        return TrainSettings.model_validate({**self.model_dump(), "total_steps": optimizer_steps})

    @model_validator(mode="after")
    def _cosine_needs_total_steps(self) -> Self:
        if self.lr_schedule == "cosine" and 0 < self.total_steps <= self.warmup_steps:
            raise ValueError(
                f"cosine schedule needs total_steps > warmup_steps; got total_steps="
                f"{self.total_steps!r}, warmup_steps={self.warmup_steps!r}"
            )
        return self


class DatasetSource(StrictModel):
    """Records read through Hugging Face `datasets`: a dataset on the Hub or a local dataset
    repository (`hf`, with `datasets.load_dataset`), or a folder written by `save_to_disk`
    (`disk`, with `datasets.load_from_disk`). The rows are checked as a file's are."""

    hf: str | None = Field(
        default=None,
        description="A Hub dataset id (openai/gsm8k) or a local folder of data files that "
        "`datasets.load_dataset` reads; needs `split`.",
    )
    disk: Path | None = Field(
        default=None,
        description="A folder written by Dataset.save_to_disk, or by DatasetDict.save_to_disk "
        "(then `split` picks one).",
    )
    name: str | None = Field(
        default=None, description="The dataset's configuration (`hf` only), e.g. main for GSM8K."
    )
    split: str | None = Field(default=None, description="The split to read, e.g. train, test.")

    @model_validator(mode="after")
    def _one_place(self) -> Self:
        if (self.hf is None) == (self.disk is None):
            raise ValueError(
                "a dataset source names exactly one of `hf` (a Hub id or a dataset folder) and "
                "`disk` (a save_to_disk folder)"
            )
        if self.hf is not None and self.split is None:
            raise ValueError(f"dataset {self.hf!r}: `split` is missing (e.g. split: train)")
        if self.disk is not None and self.name is not None:
            raise ValueError(f"dataset folder {str(self.disk)!r}: `name` is for `hf` only")
        return self


# One entry of train_files/eval_files: a parquet or JSONL file, or a `datasets` source.
DataSource = Path | DatasetSource


class DataConfig(StrictModel):
    """Prompts (RL) or conversations (SFT) in verl's dataset formats, or a generated task's
    problems."""

    train_files: list[DataSource] = Field(
        default_factory=list,
        description="Parquet or JSONL files in verl's format, or `datasets` sources "
        "({hf: ID or folder, name: CONFIG, split: SPLIT} or {disk: FOLDER, split: SPLIT}) "
        "whose rows have the same columns. RL: `prompt` as chat messages, "
        "`data_source`, `reward_model.ground_truth`, `extra_info.tools_kwargs` / "
        "`interaction_kwargs`. SFT: verl's multi-turn SFT format, `messages` as OpenAI chat "
        "messages (assistant `tool_calls` allowed, arguments as an object or JSON text) and "
        "optional `tools`, the tool schemas (a list, or JSON text). Empty: the problems of "
        "`generated_task` (SFT: the calculator's solved conversations).",
    )
    eval_files: list[DataSource] = Field(
        default_factory=list,
        description="Held-out files or `datasets` sources, as `train_files`. Empty with empty "
        "`train_files`: the generated task's test split; empty otherwise: no evaluation.",
    )
    generated_task: Literal["calculator", "search", "code", "zoom"] = Field(
        default="calculator",
        description="The problems generated when no files are named: calculator (arithmetic "
        "word problems for the calculator tool, turnrl.calculator_data, graded as GSM8K), "
        "search (questions about a generated world for the search tool over "
        "examples/search/corpus.jsonl, turnrl.search_world, Search-R1's exact match), code "
        "(large-number word problems for the python tool, turnrl.code_problems, graded as "
        "math) or zoom (an image's tiny digits for the image_zoom tool, whose session opens "
        "on the prompt's image, turnrl.zoom_digits, graded as GSM8K; a vision-language "
        "policy). SFT generates the calculator's conversations only.",
    )
    generated_train_size: int = Field(
        default=2000, gt=0, description="Generated problems to train on when no files are named."
    )
    generated_eval_size: int = Field(
        default=64, gt=0, description="Held-out generated problems when no files are named."
    )
    generated_problems: ProblemSettings = Field(
        default_factory=ProblemSettings,
        description="Shape of the generated calculator problems (the other tasks have one).",
    )
    chat_template_kwargs: dict[str, Any] = Field(
        default_factory=dict,
        description="Variables of the chat template in every render, e.g. {enable_thinking: "
        "false} for Qwen3: of each SFT conversation, and of each RL prompt and its later turns "
        "(the rollout service renders them). Give an RL run the same as the SFT run it starts "
        "from, so both render alike.",
    )
    max_eval_prompts: int | None = Field(
        default=None,
        gt=0,
        description="Evaluate on at most this many held-out prompts (SFT: conversations).",
    )
    shuffle: bool = Field(
        default=True, description="Shuffle the training prompts (SFT: conversations) every epoch."
    )


class RolloutRequestConfig(StrictModel):
    """What the trainer asks the rollout service for each step."""

    prompts_per_step: int = Field(default=8, gt=0, description="Prompts in one training batch.")
    samples_per_prompt: int = Field(
        default=8, gt=0, description="Trajectories per prompt (`n`; the GRPO group size)."
    )
    max_turns: int = Field(default=4, ge=0, description="Model turns per trajectory; 0: no cap.")
    temperature: float = Field(default=1.0, ge=0.0, description="Sampling temperature.")
    top_p: float = Field(default=1.0, gt=0.0, le=1.0, description="Nucleus sampling mass.")
    max_new_tokens: int = Field(
        default=0, ge=0, description="Tokens of one model turn; 0: the rollout service's limit."
    )
    max_response_length: int = Field(
        default=0, ge=0, description="All tokens after the prompt; 0: the rollout service's."
    )
    tools: list[str] = Field(
        default_factory=lambda: ["calculator"],
        description="Tools offered to the model, by name; the rollout service renders their "
        "schemas from the tool service it calls.",
    )
    timeout_seconds: float = Field(
        default=1800.0, gt=0, description="Deadline of one step's Generate call, in seconds."
    )


class AlgorithmConfig(StrictModel):
    """Advantages, policy loss, KL and sampling filters (names as in trainer_svc.advantages
    and trainer_svc.losses)."""

    advantage_estimator: Literal[
        "grpo",
        "dr_grpo",
        "rloo",
        "reinforce_plus_plus",
        "gae",
        "turn_reinforce_plus_plus",
        "turn_grpo",
        "turn_dr_grpo",
        "turn_gae",
    ] = Field(
        default="grpo",
        description="How rewards become advantages. gae: PPO with a value model, trained as "
        "configured in trainer.critic. turn_*: a model turn is the step, every token of a turn "
        "gets the turn's advantage (trainer_svc/advantages.py): turn_reinforce_plus_plus the "
        "whitened turn return, turn_grpo and turn_dr_grpo GRPO and Dr.GRPO per turn index "
        "within the prompt group, turn_gae GAE over turns with a critic.",
    )
    enable_turn_rewards: bool = Field(
        default=False,
        description="Add the trajectory's per-turn rewards (tools' step rewards, the "
        "interaction's turn scores, the scorer's per-turn rewards), each on the last token of "
        "its turn, to the outcome reward on the last model token. Off: they are reported "
        "(turn_reward_mean) but not trained on. With grpo, dr_grpo or rloo the trajectory's "
        "reward is then the outcome plus its turn rewards.",
    )
    gamma: float = Field(
        default=1.0,
        ge=0.0,
        le=1.0,
        description="Discount per model token (reinforce_plus_plus, gae); tool and user tokens "
        "between turns are not steps.",
    )
    turn_gamma: float = Field(
        default=1.0,
        ge=0.0,
        le=1.0,
        description="Discount per model turn (turn_*): a turn's return is its rewards plus "
        "turn_gamma times the next turn's return. 0: each turn is credited with its own rewards "
        "only.",
    )
    gae_lambda: float = Field(
        default=1.0,
        ge=0.0,
        le=1.0,
        description="GAE's lambda: 1 gives returns minus values (no bias from the critic, most "
        "variance), 0 one-step TD errors. gae and turn_gae only.",
    )
    clip_low: float = Field(default=0.2, ge=0.0, lt=1.0, description="Ratio floor is 1 - clip_low.")
    clip_high: float = Field(
        default=0.28, ge=0.0, description="Ratio ceiling is 1 + clip_high (DAPO's clip-higher)."
    )
    dual_clip: float | None = Field(
        default=None, gt=1.0, description="Dual-clip bound for negative advantages; None: off."
    )
    ratio_level: Literal["token", "sequence"] = Field(
        default="token", description="token: PPO; sequence: GSPO's length-normalised ratio."
    )
    loss_aggregation: Literal[
        "token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"
    ] = Field(default="token-mean", description="How per-token losses become the batch loss.")
    kl_coef: float = Field(
        default=0.0,
        ge=0.0,
        description="Weight of the KL to the frozen reference; 0: no reference.",
    )
    kl_in_reward: bool = Field(
        default=False, description="Subtract the KL from the reward instead of adding a loss."
    )
    kl_estimator: Literal["k1", "k2", "k3"] = Field(default="k3", description="KL estimator.")
    entropy_coef: float = Field(default=0.0, ge=0.0, description="Weight of the entropy bonus.")
    dynamic_sampling: bool = Field(
        default=False,
        description="DAPO: drop groups whose rewards are all equal and roll out more prompts.",
    )
    max_refills: int = Field(
        default=2, ge=0, description="Extra rollouts per step to refill a filtered batch."
    )
    importance_sampling: Literal["none", "truncate", "mask", "reject"] = Field(
        default="none",
        description="Behaviour-policy correction of decoupled PPO (AReaL): the PPO ratio is "
        "against the proximal policy (the trainer's logprobs before the update) and each model "
        "token is weighted by w = p_proximal / p_behaviour, the behaviour being the engine's "
        "recorded logprobs (an older policy version in async training). truncate: min(w, "
        "importance_cap) (TIS); mask: w where w <= importance_cap, else 0 (the token leaves the "
        "loss; AReaL's cap); reject: every token of a trajectory with any w > importance_cap "
        "gets 0, the others w; none: no correction (the ablation).",
    )
    importance_cap: float = Field(
        default=2.0,
        gt=0.0,
        description="The cap C on importance weights of importance_sampling (a ratio, unitless).",
    )
    ppo_epochs: int = Field(default=1, gt=0, description="Passes over each batch.")
    mini_batches: int = Field(default=1, gt=0, description="Optimizer steps per pass.")

    @property
    def trains_critic(self) -> bool:
        """Whether the estimator reads a critic's values (gae, turn_gae)."""
        return self.advantage_estimator in ("gae", "turn_gae")

    @property
    def turn_level(self) -> bool:
        """Whether the estimator takes model turns as steps (turn_*)."""
        return self.advantage_estimator.startswith("turn_")

    @model_validator(mode="after")
    def _discounts_fit_the_estimator(self) -> Self:
        # Compared with the default, not looked up in model_fields_set: `turnrl run` dumps
        # the config and validates it again, after which every field counts as set.
        fields = AlgorithmConfig.model_fields
        for name, used, users in [
            ("gae_lambda", self.trains_critic, "gae and turn_gae use it"),
            ("turn_gamma", self.turn_level, "the turn_* estimators use it"),
            # The per-token discount would be silently ignored where turns are the steps.
            ("gamma", not self.turn_level, "turn_* estimators discount per turn: turn_gamma"),
        ]:
            if getattr(self, name) != fields[name].default and not used:
                raise ValueError(
                    f"{name}={getattr(self, name)!r} is set but advantage_estimator is "
                    f"{self.advantage_estimator!r}; {users}"
                )
        return self


class CriticConfig(StrictModel):
    """The value model of advantage_estimator gae and turn_gae: the policy's transformer with a
    scalar head, trained on the same mini-batches and epochs as the policy, with its own
    optimizer."""

    model_path: str | None = Field(
        default=None,
        description="Hugging Face folder the critic starts from: a causal LM (its LM head is "
        "dropped, the value head starts at zero) or a saved token-classification model with "
        "one label. None: the policy's trainer.model_path.",
    )
    optim: TrainSettings = Field(
        default_factory=TrainSettings,
        description="The critic's optimizer, precision and micro-batches (verl's critic.optim); "
        "a critic usually takes a larger learning rate than the policy.",
    )
    value_clip_range: float | None = Field(
        default=0.5,
        gt=0.0,
        description="A value may move at most this far from the step's old value before its "
        "loss is clipped (verl's cliprange_value), in reward units; None: unclipped.",
    )
    critic_only_steps: int = Field(
        default=0,
        ge=0,
        description="First training steps that update the critic only, the policy staying "
        "as it is, so its advantages come from a critic that has seen some returns (verl's "
        "critic_warmup).",
    )


class WeightSyncConfig(StrictModel):
    """How new weights reach the rollout service after each step."""

    mode: Literal["broadcast", "grpc"] = Field(
        default="broadcast",
        description="broadcast: a torch.distributed group with the engines (falls back to grpc "
        "when it cannot be formed); grpc: the PushWeights stream.",
    )
    backend: Literal["gloo", "nccl"] = Field(default="gloo", description="Group backend.")
    master_address: str = Field(
        default="127.0.0.1",
        description="Address the engines reach this trainer's rank 0 at; the Ray launcher "
        "sets the node's address.",
    )
    bucket_size_mb: int = Field(default=100, gt=0, description="Broadcast bucket size, in MiB.")
    # Every member takes it (InitWeightSync), but SGLang servers: their API takes none.
    timeout_seconds: float = Field(default=120.0, gt=0, description="Group timeout, seconds.")


class AsyncLoopConfig(StrictModel):
    """The async loop (`trainer.loop: async`): generation streams into a replay buffer while the
    trainer trains, and weights are pushed without draining the trajectories in flight."""

    max_staleness: int = Field(
        default=1,
        ge=0,
        description="η: a trajectory whose oldest model token is more than this many policy "
        "versions behind the policy being trained is not trained on; its prompt is rolled out "
        "again. 0: on-policy (a step's rollouts start after the previous push); 1: one step "
        "off-policy (verl's); AReaL trains well up to 4 with a behaviour correction "
        "(algorithm.importance_sampling).",
    )
    max_groups_in_flight: int = Field(
        default=0,
        ge=0,
        description="Prompt groups (one Generate call of samples_per_prompt each) running at "
        "once. 0: (max_staleness + 1) x prompts_per_step + oversample_groups, all the "
        "staleness bound lets start.",
    )
    generate_while_training: bool = Field(
        default=True,
        description="Whether the engine generates while the trainer trains. True where they "
        "have devices of their own (GPUs); false where they share a CPU's cores, on which "
        "running both at once is slower than running them in turn: the engine then pauses for "
        "each step's update and push, while tool calls and scoring go on.",
    )
    oversample_groups: int = Field(
        default=0,
        ge=0,
        description="Groups started beyond the staleness bound's budget, so that a step is not "
        "starved while filtered groups (dynamic sampling) are replaced; one that then turns "
        "out too stale is rolled out again.",
    )
    max_group_attempts: int = Field(
        default=3,
        ge=1,
        description="Times one prompt group may come back unusable (no trajectory to train on) "
        "and be rolled out again; the last stops the run, naming why.",
    )
    max_unusable_share: float = Field(
        default=0.5,
        gt=0.0,
        le=1.0,
        description="Share of the groups back since the last step (once prompts_per_step are) "
        "that may be unusable; more stops the run, naming why (an unknown data_source, a "
        "scorer that always fails). 1: only max_group_attempts bounds them.",
    )


JUDGE_RUBRIC_PLACEHOLDERS = frozenset({"question", "transcript"})
DEFAULT_JUDGE_RUBRIC = (
    "Judge whether this answer is right.\n\nProblem: {question}\n\nThe answer, with its "
    "tool calls and their results:\n{transcript}\n\nEnd with 'Verdict: yes' if the final "
    "answer is right, or 'Verdict: no'."
)


class JudgeTrainingConfig(StrictModel):
    """Co-training a judge with the policy (`trainer.judge_training`;
    trainer_svc/judge_training.py). Each step, after the policy's trajectories are scored by the
    task's scorer, a judge judges each of them `samples` times from `rubric`; a verdict is
    rewarded by agreeing with the task's scorer (the reward service's judge_agreement scorer),
    and the policy's reward becomes the judges' mean verdict (plus the task's score by
    `truth_weight`). The judge is the policy's model in a second role, set by the prompt (both
    roles train in one update and get every push), or, with `model_path`, a model of its own,
    served by rollout replicas of its own (`rollout_service`), trained in an update of its own
    with the policy's optimizer settings and no KL term, and pushed to its replicas after each
    step. Held-out accuracy stays the task scorer's, so a policy that learns to fool the judge
    shows as train reward rising without it."""

    model_path: str | None = Field(
        default=None,
        description="The judge's own model (a folder or Hub id), which `rollout_service` "
        "serves; null: the policy's model judges, in a second role.",
    )
    rollout_service: ClientConfig | None = Field(
        default=None,
        description="The rollout service (one address or its replicas') that serves "
        "`model_path`; set with it, and only then.",
    )

    samples: int = Field(
        default=4, gt=0, description="Verdicts on each policy trajectory: the judge's group."
    )
    rubric: str = Field(
        default=DEFAULT_JUDGE_RUBRIC,
        description="The judge's prompt, a user message: {question} is the policy's first user "
        "message, {transcript} its turns after it (assistant text, tool calls and tool results). "
        "The verdict is its last yes/no or correct/incorrect.",
    )
    truth_weight: float = Field(
        default=0.0,
        ge=0.0,
        le=1.0,
        description="The policy's reward: (1 - truth_weight) x the judges' mean verdict + "
        "truth_weight x the task scorer's reward. 0: the judge's alone.",
    )
    temperature: float = Field(default=1.0, ge=0.0, description="The judge's sampling temperature.")
    max_new_tokens: int = Field(
        default=0, ge=0, description="Tokens of one verdict; 0: the rollout service's limit."
    )

    @model_validator(mode="after")
    def _own_model_has_its_service(self) -> Self:
        if (self.model_path is None) != (self.rollout_service is None):
            raise ValueError(
                "judge_training.model_path and judge_training.rollout_service go together: a "
                "judge of its own is served by rollout replicas of its own (both null: the "
                "policy's model judges)"
            )
        return self

    @model_validator(mode="after")
    def _rubric_fits(self) -> Self:
        try:
            fields = rubric_placeholders(self.rubric)
        except ValueError as e:
            raise ValueError(f"judge_training.{e}") from None
        unknown = fields - JUDGE_RUBRIC_PLACEHOLDERS
        if unknown or "transcript" not in fields:
            raise ValueError(
                f"judge_training.rubric has placeholders {sorted(fields)}: it must hold "
                f"{{transcript}} and may hold {{question}}, nothing else (double literal braces)"
            )
        return self


class DumpsConfig(StrictModel):
    """Trajectory dumps: JSON lines of what the agent did, in the run folder (trainer_svc/dumps.py)."""

    rollouts_per_step: int = Field(
        default=8,
        ge=0,
        description="Trajectories of each step written to rollouts/step_<N>.jsonl: the best and "
        "the worst of `extreme_groups` groups, the rest a random sample (seeded by the run's "
        "seed and the step). 0: no rollout dumps.",
    )
    extreme_groups: int = Field(
        default=2,
        ge=0,
        description="Groups, picked at random each step, whose best and worst trajectories are "
        "always among the step's dumped ones (as many as rollouts_per_step leaves room for).",
    )
    enable_eval: bool = Field(
        default=True,
        description="Write every generation of each held-out evaluation to eval/step_<N>.jsonl.",
    )


class EvalConfig(StrictModel):
    """How the RL loop's held-out evaluation samples and what it counts as solved. The default
    is greedy, one sample per prompt: eval/accuracy, the share of prompts solved."""

    n: int = Field(default=1, gt=0, description="Samples per held-out prompt.")
    temperature: float = Field(default=0.0, ge=0.0, description="Sampling temperature; 0: greedy.")
    top_p: float = Field(default=1.0, gt=0.0, le=1.0, description="Nucleus sampling mass.")
    k: list[int] = Field(
        default_factory=lambda: [1],
        description="The k of each pass@k reported (one number or a list), each at most `n`.",
    )
    success_threshold: float | None = Field(
        default=None,
        description="A sample counts as solved for pass@k when its reward is at least this. "
        "Null: the scorer's verdict, as eval/accuracy counts it (its `acc` when it reports "
        "one, else a positive reward).",
    )

    @field_validator("k", mode="before")
    @classmethod
    def _one_k_is_a_list(cls, value: Any) -> Any:
        return [value] if isinstance(value, int) else value

    @model_validator(mode="after")
    def _samples_fit(self) -> Self:
        if not self.k or min(self.k) < 1 or max(self.k) > self.n:
            raise ValueError(
                f"eval.k={self.k!r}: each k must be between 1 and eval.n={self.n!r} (pass@k "
                "draws k of the n samples of a prompt)"
            )
        if self.n > 1 and self.temperature == 0.0:
            raise ValueError(
                f"eval.n={self.n!r} with eval.temperature 0: greedy samples are all alike; "
                "set a temperature above 0 (e.g. 0.6) or n: 1"
            )
        return self


class SftConfig(StrictModel):
    """Supervised fine-tuning (`trainer.mode: sft`) on the conversations of `trainer.data`: the
    loss is the cross-entropy of the assistant messages' tokens (turnrl.chat_tokens.
    conversation_ids_and_loss_mask), averaged over those tokens."""

    conversations_per_step: int = Field(
        default=16, gt=0, description="Conversations in one optimizer step."
    )
    epochs: int | None = Field(
        default=None,
        gt=0,
        description="Passes over the training conversations, rounded up to whole steps; set, "
        "it decides the run's length in place of trainer.steps. None: trainer.steps.",
    )
    max_length: int = Field(
        default=2048,
        gt=0,
        description="Longest conversation in tokens; a longer one fails the run, naming it.",
    )

    def run_steps(self, steps: int, conversations: int) -> int:
        """A run's optimizer steps: `epochs` passes over `conversations`, rounded up to whole
        steps, or `steps` (trainer.steps) when epochs is not set."""
        if self.epochs is None:
            return steps
        return math.ceil(self.epochs * conversations / self.conversations_per_step)


class LoraSettings(StrictModel):
    """`trainer.lora`: train low-rank adapters (peft's LoRA) on the frozen base model instead of
    all its weights. The reference policy of the KL term is the same model with the adapters
    switched off; pushes carry the adapters only (`push: adapter`) or the merged weights."""

    rank: int = Field(default=8, gt=0, description="Rank r of each adapter's A (r x in) and B.")
    alpha: float = Field(
        default=16.0, gt=0, description="Scaling numerator: an adapter adds (alpha / rank) B A."
    )
    dropout: float = Field(default=0.0, ge=0.0, lt=1.0, description="Dropout on adapter inputs.")
    target_modules: list[str] = Field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"],
        min_length=1,
        description="Linear layers that get adapters, by the last part of their module name, or "
        "'all-linear' (every linear layer but the output head).",
    )
    # Not PiSSA or OLoRA: they rewrite the base weights at init, so the model with its
    # adapters switched off would no longer be the base (the KL reference), and the exported
    # adapter would not apply to the base a user holds.
    init: Literal["default", "gaussian"] = Field(
        default="default",
        description="peft's init_lora_weights: default (B = 0, so training starts from the base "
        "model) or gaussian.",
    )
    push: Literal["adapter", "merged"] = Field(
        default="adapter",
        description="What a weight push carries: the adapters only (the engine applies them), "
        "or the base weights with the adapters merged in (any engine).",
    )
    export_merged: bool = Field(
        default=False,
        description="Also write final_model/merged: the base model with the adapters merged in.",
    )


class CheckpointConfig(StrictModel):
    """`trainer.checkpoint`: when the run checkpoints and what it keeps (trainer_svc/
    checkpoint.py). A checkpoint holds each rank's shards: any number of ranks resumes it."""

    every: int = Field(
        default=10, ge=0, description="Checkpoint every this many steps (and at the end); 0: end."
    )
    keep_last: int = Field(
        default=0,
        ge=0,
        description="Keep the newest this many checkpoints, deleting older ones as each new one "
        "is complete; 0 keeps all.",
    )
    async_save: bool = Field(
        default=False,
        description="Write the shards in the background while training goes on (a copy of "
        "this rank's shards in memory until written); the next checkpoint waits for it.",
    )


class PushToHubSettings(StrictModel):
    """`trainer.push_to_hub`: upload the run's exported model to a Hugging Face Hub model repo
    (trainer_svc/hub.py), on a thread of its own so that no step waits on the network."""

    repo_id: str = Field(
        description="The model repo, 'owner/name'; created (private unless `private` is false) "
        "when it does not exist.",
    )
    private: bool = Field(default=True, description="Create the repo private.")
    every_n_steps: int | None = Field(
        default=None,
        gt=0,
        description="Also upload the model of every this many steps (exported at that step, as "
        "final_model would be), one commit each; a step whose upload would start while the "
        "previous one still runs skips it (counted in hub/skipped_uploads). None: only the "
        "final model, at the end of the run.",
    )
    include_checkpoints: bool = Field(
        default=False,
        description="Also upload the run's checkpoints/ folder (model, optimizer and RNG state "
        "of each checkpointed step) under checkpoints/ in the repo, after the final model.",
    )
    revision: str | None = Field(
        default=None,
        min_length=1,
        description="The branch to commit to, created from the default branch when missing. "
        "None: the repo's default branch (main).",
    )
    token_env: str = Field(
        default="HF_TOKEN",
        min_length=1,
        description="Environment variable of the trainer service holding the Hub token (write "
        "access); StartRun refuses a run when it is unset or empty.",
    )
    endpoint: str | None = Field(
        default=None,
        description="The Hub's URL. None: huggingface_hub's, $HF_ENDPOINT or huggingface.co.",
    )

    @field_validator("repo_id")
    @classmethod
    def _repo_id_names_owner_and_name(cls, repo_id: str) -> str:
        if not REPO_ID.fullmatch(repo_id):
            raise ValueError(
                f"repo_id {repo_id!r} is not 'owner/name' (letters, digits, '-', '_' and '.', "
                "one '/'); the owner is your Hub user or organization"
            )
        return repo_id


class WandbSettings(StrictModel):
    """The wandb run of a run (trainer.loggers: [wandb]). Its id is made once per run and kept
    in the run folder (trainer_svc.trackers), so a --resume continues it and no two runs,
    whatever their names, share one."""

    mode: Literal["offline", "online"] = Field(
        default="offline",
        description="offline: files in <run folder>/wandb/ only (`wandb sync` uploads them); "
        "online: streamed to the server, which needs WANDB_API_KEY.",
    )
    project: str = Field(default="turnrl", min_length=1, description="wandb project.")
    entity: str | None = Field(
        default=None, description="wandb user or team; None: the API key's default entity."
    )
    group: str | None = Field(default=None, description="wandb group of related runs.")
    tags: list[str] = Field(default_factory=list, description="wandb tags of the run.")


class MlflowSettings(StrictModel):
    """The MLflow run of a run (trainer.loggers: [mlflow]); its id is kept in the run folder,
    so a --resume continues it."""

    tracking_uri: str | None = Field(
        default=None,
        description="MLflow tracking server or store, e.g. http://host:5000 or "
        "sqlite:///path/mlflow.db. None: an SQLite store in the run folder, "
        "<run folder>/mlflow.db.",
    )
    experiment: str = Field(
        default="turnrl", min_length=1, description="MLflow experiment, made if missing."
    )


class TrainerConfig(StrictModel):
    """Settings of the trainer service and of the run it is given."""

    server: ServerConfig = Field(
        default_factory=lambda: ServerConfig(port=DEFAULT_PORTS["trainer"]),
        description="Where and how the trainer service listens.",
    )
    ranks: int = Field(
        default=1,
        ge=1,
        description="Processes the trainer service runs as: torchrun --nproc-per-node on this "
        "machine, or one per rank on any nodes (the Ray launcher). The models are sharded "
        "across them (FSDP2) and each computes its share of every batch. A run must ask for the "
        "number its service runs.",
    )
    run_name: str = Field(default="calculator", min_length=1, description="Name of the run.")
    mode: Literal["rl", "sft", "eval"] = Field(
        default="rl",
        description="rl: the RL loop (trainer.loop), through the rollout, tool and reward "
        "services. sft: supervised fine-tuning on written conversations (trainer.sft), in this service alone: "
        "rollout_service, rollout, algorithm and weight_sync are not used. eval: the RL loop's "
        "held-out evaluation (trainer.eval), once, of the model the rollout service serves; "
        "nothing is trained (`turnrl eval`).",
    )
    loop: Literal["sync", "async"] = Field(
        default="sync",
        description="RL only. sync: roll out a batch, train, push, repeat. async: keep the "
        "rollout service busy, train on each batch as soon as it is ready, push without "
        "draining (trainer.async_loop).",
    )
    async_loop: AsyncLoopConfig = Field(
        default_factory=AsyncLoopConfig, description="The async loop (loop: async)."
    )
    output_dir: Path = Field(
        default=RUNS_FOLDER,
        description="Runs are written to <output_dir>/<run name>/, inside the runs root.",
    )
    runs_root: Path | None = Field(
        default=None,
        description="The trainer service's own (a run's is ignored): StartRun refuses with "
        "INVALID_ARGUMENT a run folder that resolves outside it. None: its trainer.output_dir.",
    )
    model_path: str | None = Field(
        default=None,
        description="The initial policy, a Hugging Face folder. Null: in a run submitted to a "
        "trainer service, the model that service was started with (a run with neither fails "
        "with a ConfigError); in a config file, `turnrl serve`, `up` and `run` set it to the "
        "tiny calculator model of the config's `tiny_model` (turnrl_demo). Must be the model "
        "the rollout service serves.",
    )
    steps: int = Field(
        default=20, gt=0, description="Training steps of the run (SFT: unless sft.epochs is set)."
    )
    eval_every: int = Field(
        default=5,
        ge=0,
        description="Evaluate every this many steps (and at start and end); 0: only at start "
        "and end. RL: held-out accuracy; SFT: held-out loss.",
    )
    eval: EvalConfig = Field(
        default_factory=EvalConfig,
        description="RL and eval: the held-out evaluation's sampling and pass@k.",
    )
    checkpoint: CheckpointConfig = Field(
        default_factory=CheckpointConfig, description="Checkpoints: how often, how many kept."
    )
    seed: int = Field(default=0, description="Seeds data order and sampling.")
    rollout_service: ClientConfig = Field(
        default_factory=lambda: ClientConfig(address=f"127.0.0.1:{DEFAULT_PORTS['rollout']}"),
        description="The rollout service: one address, or its replicas' comma-separated, over "
        "which the trainer's router spreads prompt groups by load (trainer_svc/rollout_router.py); "
        "`turnrl up`/`run` fill in the ones they started.",
    )
    data: DataConfig = Field(
        default_factory=DataConfig, description="Training and eval prompts or conversations."
    )
    sft: SftConfig = Field(
        default_factory=SftConfig, description="Supervised fine-tuning (mode: sft)."
    )
    rollout: RolloutRequestConfig = Field(
        default_factory=RolloutRequestConfig, description="The rollouts of each step."
    )
    algorithm: AlgorithmConfig = Field(
        default_factory=AlgorithmConfig, description="The RL algorithm."
    )
    optim: TrainSettings = Field(
        default_factory=TrainSettings, description="Optimizer, precision and micro-batches."
    )
    lora: LoraSettings | None = Field(
        default=None, description="Low-rank adapters to train; null trains every weight."
    )
    critic: CriticConfig = Field(
        default_factory=CriticConfig,
        description="The value model; only with algorithm.advantage_estimator gae or turn_gae.",
    )
    weight_sync: WeightSyncConfig = Field(
        default_factory=WeightSyncConfig, description="Weight pushes to the rollout service."
    )
    judge_training: JudgeTrainingConfig | None = Field(
        default=None,
        description="RL only (sync or async loop). Co-train a judge: the policy's model, or "
        "one of its own, judges the policy's trajectories and the policy is rewarded by the "
        "verdicts; null: no judge.",
    )
    dumps: DumpsConfig = Field(
        default_factory=DumpsConfig,
        description="RL only. Trajectory dumps under the run folder: rollouts/ and eval/.",
    )
    push_to_hub: PushToHubSettings | None = Field(
        default=None,
        description="Upload the exported model to the Hugging Face Hub; null: no upload.",
    )
    loggers: list[Literal["wandb", "tensorboard", "mlflow"]] = Field(
        default_factory=lambda: ["wandb"],
        description="Trackers each step's metrics go to besides metrics.jsonl (always "
        "written), each set in its own key: wandb (trainer.wandb), tensorboard (event files "
        "in <run folder>/tensorboard/), mlflow (trainer.mlflow). [] logs to metrics.jsonl only.",
    )
    wandb: WandbSettings = Field(
        default_factory=WandbSettings, description="The wandb run (loggers: [wandb])."
    )
    mlflow: MlflowSettings = Field(
        default_factory=MlflowSettings, description="The MLflow run (loggers: [mlflow])."
    )

    @model_validator(mode="after")
    def _tracker_settings_have_their_logger(self) -> Self:
        if len(set(self.loggers)) != len(self.loggers):
            raise ValueError(f"loggers names a tracker twice: {self.loggers!r}")
        for name, default in (("wandb", WandbSettings()), ("mlflow", MlflowSettings())):
            if getattr(self, name) != default and name not in self.loggers:  # as for critic
                raise ValueError(
                    f"{name} is set but loggers is {self.loggers!r}; add {name!r} to loggers "
                    "to use it"
                )
        return self

    @model_validator(mode="after")
    def _async_loop_fits_the_run(self) -> Self:
        if self.async_loop != AsyncLoopConfig() and self.loop != "async":  # as for critic
            raise ValueError("async_loop is set but loop is 'sync'; set loop: async to use it")
        if self.loop == "async" and self.mode == "sft":
            raise ValueError("loop: async is an RL loop; an SFT run (mode: sft) has no rollouts")
        return self

    @model_validator(mode="after")
    def _judge_training_fits_the_run(self) -> Self:
        if self.judge_training is not None and self.mode != "rl":
            raise ValueError(
                f"judge_training is set but the run is mode {self.mode!r}: a judge is "
                "co-trained by RL runs only (mode: rl)"
            )
        if self.judge_model_path is not None and self.algorithm.trains_critic:
            raise ValueError(
                f"judge_training.model_path is set with advantage_estimator "
                f"{self.algorithm.advantage_estimator!r}: a judge of its own has no critic; "
                "use a group estimator (grpo, rloo, ...) or let the policy's model judge"
            )
        return self

    @property
    def judge_model_path(self) -> str | None:
        """A co-trained judge's own model; None without a judge or when the policy's model
        judges."""
        return self.judge_training.model_path if self.judge_training is not None else None

    @model_validator(mode="after")
    def _sft_data_exists(self) -> Self:
        task = self.data.generated_task
        if self.mode == "sft" and not self.data.train_files and task != "calculator":
            raise ValueError(
                f"an SFT run without data.train_files generates the calculator's conversations "
                f"only, not {task}'s (whose tool answers come from the tool service); name "
                "files of conversations in data.train_files"
            )
        return self

    @model_validator(mode="after")
    def _critic_fits_the_algorithm(self) -> Self:
        estimator = self.algorithm.advantage_estimator
        trains_critic = self.algorithm.trains_critic
        # Compared with the default, as in _discounts_fit_the_estimator.
        if self.critic != CriticConfig() and not trains_critic:
            raise ValueError(
                f"critic is set but algorithm.advantage_estimator is {estimator!r}; only gae "
                "and turn_gae train a critic"
            )
        if trains_critic and self.critic.critic_only_steps >= self.steps:
            raise ValueError(
                f"critic.critic_only_steps={self.critic.critic_only_steps!r} leaves no step of "
                f"the {self.steps!r} (steps) to train the policy; make it smaller than steps"
            )
        return self
