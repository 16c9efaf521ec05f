"""The SFT loop of one run (`trainer.mode: sft`): supervised fine-tuning on written multi-turn
conversations, for a warm start before RL. It runs in the trainer service alone: no rollout,
tool or reward service, no weight push.

    setup     model, tokenizer; the conversations of `trainer.data`, each tokenized once as the
              trajectory of a policy that wrote its assistant messages (loss mask on those
              tokens: turnrl.chat_tokens.conversation_ids_and_loss_mask); resume from the last
              checkpoint
    step      the next `sft.conversations_per_step` conversations -> one optimizer step on the
              cross-entropy of their assistant tokens (token mean) -> [held-out loss]
              -> [checkpoint]

Micro-batching, the LR schedule and gradient clipping are `FsdpPolicy.train_step`'s, as in RL;
stop and checkpoint requests, the report and the end of the run are `RunLoop`'s. On several
ranks each trains on its share of a step's conversations (`sft_step` runs on every rank).
`sft_in_process` takes the same steps in a plain process, without a service, report or
checkpoint: the tiny demo model's fine-tuning (turnrl_demo.tiny_model).
"""

import asyncio
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import jinja2
import torch
from torch import Tensor

from trainer_svc.batch import Batch
from trainer_svc.config import LoraSettings, SftConfig, TrainSettings
from trainer_svc.data import ConversationRecord, EpochSampler, load_conversations
from trainer_svc.fsdp import FsdpPolicy
from trainer_svc.ranks import Models, share_of
from trainer_svc.report import LOSS_PLOT
from trainer_svc.run_loop import FINAL_MODEL, ProgressEvent, RunLoop
from turnrl.chat_tokens import conversation_ids_and_loss_mask
from turnrl.errors import ConfigError, TurnrlError
from turnrl.images import trajectory_images
from turnrl.vision import ProcessedImage, VisionProcessor


class Example(NamedTuple):
    """One conversation as the policy trains on it."""

    token_ids: list[int]
    loss_mask: list[bool]
    images: list[ProcessedImage]  # a vision-language policy's, in the order of their tokens


def sft_loss(
    micro: Batch, logprobs: Tensor, entropy: Tensor | None
) -> tuple[Tensor, dict[str, float]]:
    """Cross-entropy of the loss tokens: this micro-batch's share of the step's mean over all
    its loss tokens (the `FsdpPolicy.train_step` contract)."""
    return -torch.where(micro.loss_mask, logprobs, 0.0).sum() / micro.global_token_count, {}


def tokenize_conversations(
    tokenizer: Any,
    records: list[ConversationRecord],
    max_length: int,
    chat_template_kwargs: dict[str, Any] | None = None,
    vision: VisionProcessor | None = None,
) -> list[Example]:
    """Each conversation's ids and loss mask, with the tokenizer's chat template, and its
    images as `vision` (a vision-language policy's processor) makes them. Raises ConfigError
    naming a conversation the template cannot split into model turns, one with images for a
    text-only policy, or one longer than `max_length` tokens."""
    examples = []
    for record in records:
        try:
            loaded = trajectory_images(record.messages)
            images = [vision.process(image) for image in loaded] if vision else []
            ids, loss_mask = conversation_ids_and_loss_mask(
                tokenizer,
                record.messages,
                record.tools,
                chat_template_kwargs=chat_template_kwargs,
                vision=vision,
                images=images,
            )
        # The template's own errors too: it may refuse messages (a role order, a content type).
        except (TurnrlError, jinja2.TemplateError, TypeError, ValueError, KeyError) as e:
            raise ConfigError(f"conversation {record.conversation_id}: {e}") from e
        if len(ids) > max_length:
            raise ConfigError(
                f"conversation {record.conversation_id} has {len(ids)} tokens, more than "
                f"trainer.sft.max_length={max_length}"
            )
        examples.append(Example(ids, loss_mask, images))
    return examples


def examples_batch(examples: list[Example], pad_token_id: int) -> Batch:
    """The examples as one right-padded batch, the loss on their loss-mask tokens."""
    return Batch.from_sequences(
        [example.token_ids for example in examples],
        [example.loss_mask for example in examples],
        pad_token_id=pad_token_id,
        images=[example.images for example in examples],
    )


def sft_models(model_path: str, optim: TrainSettings, lora: LoraSettings | None = None) -> Models:
    """An SFT run's one model, the policy (with `lora`, adapters on a frozen base)."""
    return Models(policy=FsdpPolicy(model_path, optim, lora))


def sft_step(models: Models, batch: Batch) -> dict[str, float]:
    """One optimizer step on the conversations of `batch`, this rank on its share (every rank)."""
    rows = list(range(batch.input_ids.shape[0]))
    return models.policy.train_step(share_of(models, batch, rows), sft_loss)


def sft_in_process(
    model_path: str | Path,
    examples: list[Example],
    pad_token_id: int,
    *,
    sft: SftConfig,
    optim: TrainSettings,
    steps: int,
    seed: int,
    on_step: Callable[[int, int, dict[str, float]], None] | None = None,
) -> Models:
    """Fine-tunes the model in `model_path` on `examples` in this process, on one rank, with
    the steps of an SFT run (`SftController`): the examples in a new shuffled order each epoch
    (`EpochSampler`), `sft.conversations_per_step` a step, `sft_step` under `optim`'s schedule over
    `sft.run_steps(steps, ...)` steps. No report, evaluation or checkpoint. Calls
    `on_step(step, total_steps, metrics)` after each step (from 1); returns the trained models
    (on one rank, `models.policy.model` is the whole model). Blocks for the whole run."""
    sampler = EpochSampler(examples, seed, shuffle=True)
    total_steps = sft.run_steps(steps, len(examples))
    models = sft_models(str(model_path), optim.for_run(total_steps))
    for step in range(1, total_steps + 1):
        batch = examples_batch(sampler.next_batch(sft.conversations_per_step), pad_token_id)
        metrics = sft_step(models, batch)
        if on_step is not None:
            on_step(step, total_steps, metrics)
    return models


def held_out_loss(models: Models, batch: Batch) -> float:
    """Cross-entropy per loss token over the conversations of `batch` (every rank)."""
    logprobs, _ = models.policy.logprobs(batch)
    return float(-logprobs[batch.loss_mask].sum() / batch.loss_mask.sum())


class SftController(RunLoop):
    """Runs one SFT run to its end, or until `request_stop`."""

    def _planned_steps(self) -> int:
        # With sft.epochs, counted from the data at setup.
        return 0 if self.config.sft.epochs is not None else self.config.steps

    async def run(self, resume: bool, resume_from: str | None = None) -> dict[str, Any]:
        started = time.monotonic()
        config = self.config
        model_path, tokenizer = await self._model_and_tokenizer()
        train, held_out = await asyncio.to_thread(load_conversations, config.data, config.seed)
        max_length = config.sft.max_length
        self.train_examples, self.held_out_examples = [
            await asyncio.to_thread(
                tokenize_conversations,
                tokenizer,
                records,
                max_length,
                config.data.chat_template_kwargs,
                self.vision,
            )
            for records in (train, held_out)
        ]
        self.sampler = EpochSampler(self.train_examples, config.seed, config.data.shuffle)
        self.total_steps = config.sft.run_steps(config.steps, len(self.train_examples))
        optim = config.optim.for_run(self.total_steps)
        await self.ranks.build(sft_models, model_path, optim, config.lora)
        resumed = resume and await self._restore_checkpoint(resume_from) is not None
        await self._open_report(resumed, LOSS_PLOT)
        await self._open_hub_repo()
        tokens = sum(len(example.token_ids) for example in self.train_examples)
        loss_tokens = sum(sum(example.loss_mask) for example in self.train_examples)
        message = (
            f"model {model_path}; {len(self.train_examples)} conversations of {tokens} tokens, "
            f"{loss_tokens} of them trained on; {len(self.held_out_examples)} held out"
        )
        self.emit(ProgressEvent(self.step, "setup", message=message))
        await self._train_to_end()
        return await self._finish(model_path, started)

    async def _train_step(self) -> None:
        self.step += 1
        examples = self.sampler.next_batch(self.config.sft.conversations_per_step)
        batch = examples_batch(examples, self.pad_token_id)
        started = time.monotonic()
        result = await self.ranks.run(sft_step, batch)
        seconds = time.monotonic() - started
        metrics = {
            "train/loss": result["loss"],
            "train/grad_norm": result["grad_norm"],
            "train/lr": result["lr"],
            "train/loss_tokens": float(batch.loss_mask.sum()),
            "train/tokens_per_s": float(batch.attention_mask.sum()) / seconds,
            "train/epoch": self.sampler.position / len(self.train_examples),
            "time/train": seconds,
        }
        self.report.log(self.step, metrics)
        self.emit(ProgressEvent(self.step, "train", metrics))
        await self._finish_step()

    async def _evaluate(self) -> None:
        if not self.held_out_examples:
            return
        started = time.monotonic()
        batch = examples_batch(self.held_out_examples, self.pad_token_id)
        loss = await self.ranks.run(held_out_loss, batch)
        metrics = {
            "eval/loss": loss,
            "eval/step": float(self.step),
            "time/eval": time.monotonic() - started,
        }
        self.report.log(self.step, metrics)
        message = f"held-out loss {loss:.4f} on {len(self.held_out_examples)} conversations"
        self.emit(ProgressEvent(self.step, "eval", metrics, message))

    async def _checkpoint(self) -> None:
        await self._save_checkpoint({}, {"data_position": self.sampler.position})

    def _summary(self, wall_seconds: float) -> dict[str, Any]:
        report = self.report
        return {
            "run_name": self.run_dir.name,
            "mode": "sft",
            "steps": self.step,
            "stopped_early": self.step < self.total_steps,
            "epochs": round(self.sampler.position / len(self.train_examples), 3),
            "initial_eval_loss": report.first("eval/loss"),
            "final_eval_loss": report.last("eval/loss"),
            "initial_train_loss": report.first("train/loss"),
            "final_train_loss": report.last("train/loss"),
            "wall_seconds": round(wall_seconds, 1),
            "final_model": str(self.run_dir / FINAL_MODEL),
        }
