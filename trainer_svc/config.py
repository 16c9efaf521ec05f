"""The `trainer:` section of a turnrl config: the run and its mode (RL or SFT), its data, the
rollouts it asks for, the RL algorithm, the SFT batches, the optimizer and where the other
services are."""

import math
from pathlib import Path
from typing import Any, Literal, Self

from pydantic import Field, model_validator

from turnrl.calculator_data import ProblemSettings
from turnrl.config import DEFAULT_PORTS, ClientConfig, ServerConfig, StrictModel

RUNS_FOLDER = Path("runs")  # the default trainer.output_dir, and so the default runs root


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
        description="Token budget of one micro-batch: rows x its longest row; with "
        "shared_prefix_forward, the tokens of its three forwards, padding included (each: "
        "its prefixes or rows x the most tokens one of them computes).",
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


class DataConfig(StrictModel):
    """Prompts (RL) or conversations (SFT) in verl's dataset formats, or a generated task's
    problems."""

    train_files: list[Path] = Field(
        default_factory=list,
        description="Parquet or JSONL files in verl's format. RL: `prompt` as chat messages, "
        "`data_source`, `reward_model.ground_truth`, `extra_info.tools_kwargs` / "
        "`interaction_kwargs`. SFT: verl's multi-turn SFT format, `messages` as OpenAI chat "
        "messages (assistant `tool_calls` allowed, arguments as an object or JSON text) and "
        "optional `tools`, the tool schemas (a list, or JSON text). Empty: the problems of "
        "`generated_task` (SFT: the calculator's solved conversations).",
    )
    eval_files: list[Path] = Field(
        default_factory=list,
        description="Held-out files in the same format. Empty with empty `train_files`: the "
        "generated task's test split; empty otherwise: no evaluation.",
    )
    generated_task: Literal["calculator", "search", "code"] = Field(
        default="calculator",
        description="The problems generated when no files are named: calculator (arithmetic "
        "word problems for the calculator tool, turnrl.calculator_data, graded as GSM8K), "
        "search (questions about a generated world for the search tool over "
        "examples/search/corpus.jsonl, turnrl.search_world, Search-R1's exact match) or code "
        "(large-number word problems for the python tool, turnrl.code_problems, graded as "
        "math). SFT generates the calculator's conversations only.",
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

    advantage_estimator: Literal["grpo", "dr_grpo", "rloo", "reinforce_plus_plus", "gae"] = Field(
        default="grpo",
        description="How rewards become advantages. gae: PPO with a value model, trained as "
        "configured in trainer.critic.",
    )
    gamma: float = Field(
        default=1.0,
        ge=0.0,
        le=1.0,
        description="Discount per model token (reinforce_plus_plus, gae); tool and user tokens "
        "between turns are not steps.",
    )
    gae_lambda: float = Field(
        default=1.0,
        ge=0.0,
        le=1.0,
        description="GAE's lambda: 1 gives returns minus values (no bias from the critic, most "
        "variance), 0 one-step TD errors. gae only.",
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

    @model_validator(mode="after")
    def _gae_lambda_needs_gae(self) -> Self:
        # Compared with the default, not looked up in model_fields_set: `turnrl run` dumps
        # the config and validates it again, after which every field counts as set.
        default = AlgorithmConfig.model_fields["gae_lambda"].default
        if self.gae_lambda != default and self.advantage_estimator != "gae":
            raise ValueError(
                f"gae_lambda={self.gae_lambda!r} is set but advantage_estimator is "
                f"{self.advantage_estimator!r}; only gae uses it"
            )
        return self


class CriticConfig(StrictModel):
    """The value model of advantage_estimator gae: the policy's transformer with a scalar head,
    trained on the same mini-batches and epochs as the policy, with its own optimizer."""

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
    mode: Literal["rl", "sft"] = Field(
        default="rl",
        description="rl: the RL loop (trainer.loop), through the rollout, tool and reward "
        "services. sft: supervised fine-tuning on written conversations (trainer.sft), in this service alone: "
        "rollout_service, rollout, algorithm and weight_sync are not used.",
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
    checkpoint_every: int = Field(
        default=10, ge=0, description="Checkpoint every this many steps (and at the end); 0: end."
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
    critic: CriticConfig = Field(
        default_factory=CriticConfig,
        description="The value model; only with algorithm.advantage_estimator gae.",
    )
    weight_sync: WeightSyncConfig = Field(
        default_factory=WeightSyncConfig, description="Weight pushes to the rollout service."
    )
    wandb_mode: Literal["offline", "online", "disabled"] = Field(
        default="offline",
        description="wandb logging; online needs WANDB_API_KEY. Files go under the run folder.",
    )

    @model_validator(mode="after")
    def _async_loop_fits_the_run(self) -> Self:
        if self.async_loop != AsyncLoopConfig() and self.loop != "async":  # as for critic
            raise ValueError("async_loop is set but loop is 'sync'; set loop: async to use it")
        if self.loop == "async" and self.mode == "sft":
            raise ValueError("loop: async is an RL loop; an SFT run (mode: sft) has no rollouts")
        return self

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
        if self.critic != CriticConfig() and estimator != "gae":  # as in _gae_lambda_needs_gae
            raise ValueError(
                f"critic is set but algorithm.advantage_estimator is {estimator!r}; only gae "
                "trains a critic"
            )
        if estimator == "gae" and self.critic.critic_only_steps >= self.steps:
            raise ValueError(
                f"critic.critic_only_steps={self.critic.critic_only_steps!r} leaves no step of "
                f"the {self.steps!r} (steps) to train the policy; make it smaller than steps"
            )
        return self
