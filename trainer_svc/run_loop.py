"""What the loop of every kind of run shares: the RL `Controller` (trainer_svc/controller.py)
and the SFT `SftController` (trainer_svc/sft.py) are both a `RunLoop`, which holds the run's
step, its stop and checkpoint requests, its report and the end of the run (a last checkpoint,
the exported model, its upload to the Hub, summary.json)."""

import abc
import asyncio
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from transformers import AutoTokenizer

from trainer_svc.checkpoint import (
    CHECKPOINTS,
    CheckpointState,
    find_checkpoint,
    finish_checkpoint,
    new_staging_folder,
)
from trainer_svc.config import TrainerConfig
from trainer_svc.data import EpochSampler
from trainer_svc.hub import HubPublisher, HubUploadError
from trainer_svc.ranks import Ranks, restore, save_checkpoint_shards, save_pretrained
from trainer_svc.report import Plot, RunReport
from turnrl.vision import VisionProcessor, vision_token_id

# The last policy in Hugging Face format (with LoRA, peft's adapter folder), beside summary.json.
FINAL_MODEL = "final_model"


@dataclass
class ProgressEvent:
    """One finished stage of a run."""

    step: int
    stage: str  # setup, rollout, train, push, eval, checkpoint, upload, done
    metrics: dict[str, float] = field(default_factory=dict)
    message: str = ""


@dataclass
class CheckpointRequest:
    """A SaveCheckpoint call waiting for the end of the current step."""

    done: asyncio.Future  # resolves to (checkpoint folder, step)


class RunLoop(abc.ABC):
    """What the loop of every kind of run shares (the RL `Controller` here, and
    trainer_svc.sft.SftController): its step, stop and checkpoint requests, its report, and the
    end of the run. A subclass's `run` builds its models with `ranks.build`, opens its report
    and its Hub repo (`_open_report`, `_open_hub_repo`), writes checkpoints with `_checkpoint`
    and describes the run with `_summary`."""

    sampler: EpochSampler
    report: RunReport

    def __init__(
        self,
        config: TrainerConfig,
        run_dir: Path,
        emit: Callable[[ProgressEvent], None],
        ranks: Ranks,
    ) -> None:
        self.config = config
        self.ranks = ranks
        self.run_dir = run_dir
        self.emit = emit
        self.step = 0
        self.total_steps = self._planned_steps()
        self.stop_requested = False
        self.checkpoint_requests: list[CheckpointRequest] = []
        self._checkpointed_step = -1
        # The completion of the checkpoint being written in the background, if any.
        self._checkpoint_finishing: asyncio.Task | None = None
        self.publisher: HubPublisher | None = None  # with trainer.push_to_hub, from setup on
        self.vision: VisionProcessor | None = None  # a vision-language policy's, from setup on

    def _planned_steps(self) -> int:
        """The run's length as known before setup (a subclass may count it from its data)."""
        return self.config.steps

    def request_stop(self) -> None:
        self.stop_requested = True

    def close(self) -> None:
        """Lets go of what a run that ended, or failed, may still hold: an upload to the Hub."""
        if self.publisher is not None:
            self.publisher.close()

    @abc.abstractmethod
    async def run(self, resume: bool, resume_from: str | None = None) -> dict[str, Any]:
        """Trains to `total_steps` or a stop, with `resume` from the checkpoint `resume_from`
        names (`checkpoint.find_checkpoint`: its newest when None); returns the summary
        written to summary.json."""

    @abc.abstractmethod
    async def _train_step(self) -> None:
        """Takes the next step, then `_finish_step`."""

    @abc.abstractmethod
    async def _evaluate(self) -> None:
        """Measures the policy on the held-out data and logs it, with `eval/step`."""

    @abc.abstractmethod
    async def _checkpoint(self) -> None:
        """Saves this step's checkpoint with `_save_checkpoint`."""

    @abc.abstractmethod
    def _summary(self, wall_seconds: float) -> dict[str, Any]:
        """What summary.json says about the run."""

    async def _model_and_tokenizer(self) -> tuple[str, Any]:
        """The initial policy's folder (TrainerService.start_run made sure the run names one)
        and its tokenizer; sets `pad_token_id`, and `vision` for a vision-language policy."""
        model_path = self.config.model_path
        assert model_path is not None, "StartRun refuses a run without a model"
        tokenizer = await asyncio.to_thread(AutoTokenizer.from_pretrained, model_path)
        self.pad_token_id = pad_token_id(tokenizer)
        if await asyncio.to_thread(vision_token_id, model_path) is not None:
            self.vision = await asyncio.to_thread(VisionProcessor, model_path)
        return model_path, tokenizer

    async def _restore_checkpoint(self, name: str | None) -> dict[str, Any] | None:
        """Restores the models, the data position and the step of the run's checkpoint named
        `name` (`checkpoint.find_checkpoint`), or of its newest; returns the checkpoint's
        state, or None when there is none."""
        folder = await asyncio.to_thread(find_checkpoint, self.run_dir, name)
        if folder is None:
            return None
        state = await self.ranks.run(restore, folder)
        self.sampler.position = state["data_position"]
        self.step = self._checkpointed_step = state["step"]
        return state

    async def _open_report(self, resumed: bool, plot: Plot) -> None:
        """Opens the run's report and its trackers, off the loop (wandb takes seconds)."""
        resumed_step = self.step if resumed else None
        self.report = await asyncio.to_thread(
            RunReport, self.run_dir, self.config, plot, resumed_step
        )

    async def _open_hub_repo(self) -> None:
        """With trainer.push_to_hub, creates the repo unless it exists, before the first step:
        a token or repo the Hub refuses fails the run now (HubUploadError)."""
        if self.config.push_to_hub is None:
            return
        self.publisher = HubPublisher(self.config.push_to_hub, self.run_dir.name, self._on_upload)
        await self.publisher.open_repo()

    def _on_upload(self, metrics: dict[str, float], message: str) -> None:
        """An upload's result (`message` names its step), logged and sent at the run's current
        step: the upload's may be past, and the steps a run logs go forward."""
        self.report.log(self.step, metrics)
        self.emit(ProgressEvent(self.step, "upload", metrics, message))

    async def _train_to_end(self) -> None:
        """Evaluates the starting policy, steps to `total_steps` or a stop, evaluates the last."""
        if self.step == 0:
            await self._evaluate()
        while self.step < self.total_steps and not self.stop_requested:
            await self._train_step()
        if self.report.last("eval/step") != self.step:
            await self._evaluate()

    async def _finish_step(self) -> None:
        """The end of a step: evaluate every `eval_every` steps (the last step's evaluation is
        the run's final one), checkpoint every `checkpoint.every` steps or when asked to, start
        an upload to the Hub every `push_to_hub.every_n_steps`. A checkpoint that failed to be
        written in the background fails the run here."""
        if self._checkpoint_finishing is not None and self._checkpoint_finishing.done():
            self._checkpoint_finishing.result()
        every = self.config.eval_every
        if every and self.step % every == 0 and self.step < self.total_steps:
            await self._evaluate()
        every = self.config.checkpoint.every
        if (every and self.step % every == 0) or self.checkpoint_requests:
            await self._checkpoint()
        last = self.step == self.total_steps  # whose upload is the final model's
        if self.publisher is not None and not last and self.publisher.ready_for(self.step):
            # The export is this step's (the model trains on); its upload runs in the background.
            folder = tempfile.mkdtemp(prefix=f".upload-step_{self.step:06d}-", dir=self.run_dir)
            await self.ranks.run(
                save_pretrained, Path(folder), self.config.model_path, self.config.judge_model_path
            )
            self.publisher.start_step_upload(self.step, Path(folder))

    async def _save_checkpoint(self, tensors: dict[str, Any], loop_state: dict[str, Any]) -> None:
        """Checkpoints this step: the models' shards, written by every rank, and beside them
        `tensors` (small ones) and `loop_state` (JSON values), the loop's state now. With
        `checkpoint.async_save` the shards are written in the background and the checkpoint
        completed when they are; either way the SaveCheckpoint calls waiting are answered
        once it is complete."""
        settings = self.config.checkpoint
        staging = await asyncio.to_thread(new_staging_folder, self.run_dir, self.step)
        plain, writing = await self.ranks.run(save_checkpoint_shards, staging, settings.async_save)
        state = CheckpointState.now(self.step, {**plain, **tensors}, loop_state)
        self._checkpointed_step = self.step
        requests, self.checkpoint_requests = self.checkpoint_requests, []
        finishing = self._complete_checkpoint(
            staging, state, writing, requests, self._checkpoint_finishing
        )
        if writing is None:
            await finishing
        else:
            self._checkpoint_finishing = asyncio.create_task(finishing)

    async def _complete_checkpoint(
        self,
        staging: Path,
        state: CheckpointState,
        writing: Future | None,
        requests: list[CheckpointRequest],
        previous: asyncio.Task | None,
    ) -> None:
        """Once the checkpoint before it is complete and this one's shards are written
        (`writing`), completes the checkpoint in `staging` with `state` and answers
        `requests`."""
        if previous is not None:
            await previous
        if writing is not None:
            await asyncio.wrap_future(writing)
        folder = await asyncio.to_thread(
            finish_checkpoint, staging, self.run_dir, state, self.config.checkpoint.keep_last
        )
        for request in requests:
            request.done.set_result((folder, state.step))
        self.emit(ProgressEvent(state.step, "checkpoint", message=str(folder)))

    async def _finish(self, model_path: str, started: float) -> dict[str, Any]:
        """Ends the run: a checkpoint of its last step, the policy in Hugging Face format in
        final_model/ (`ranks.save_pretrained`; a co-trained judge's own model in
        final_model/judge) and, with push_to_hub, its upload, then
        curves.png and summary.json, which also counts the parameters trained (with LoRA, the
        adapters') and says where the upload went; returns the summary. Raises HubUploadError,
        after writing summary.json, when the final upload failed."""
        if self._checkpointed_step != self.step:
            await self._checkpoint()
        if self._checkpoint_finishing is not None:
            await self._checkpoint_finishing
        export = self.run_dir / FINAL_MODEL
        await self.ranks.run(save_pretrained, export, model_path, self.config.judge_model_path)
        summary = self._summary(time.monotonic() - started)
        trained = self.ranks.models.policy.trainable_parameters
        summary["trainable_parameters"] = sum(parameter.numel() for parameter in trained)
        hub = None
        if self.publisher is not None:
            hub = await self.publisher.finish(self.step, export, self.run_dir / CHECKPOINTS)
            summary["hub"] = hub
        summary = await asyncio.to_thread(self.report.finish, summary)
        message = f"summary {self.run_dir}/summary.json"
        if hub is not None:
            if hub["final_upload_error"] is not None:
                raise HubUploadError(
                    f"the final model was not uploaded to {hub['repo_id']!r} "
                    f"({hub['final_upload_error']}); it is in {export}"
                )
            message += f"; uploaded to {hub['commit_url']}"
        self.emit(ProgressEvent(self.step, "done", message=message))
        return summary


def pad_token_id(tokenizer: Any) -> int:
    """The id a batch pads a model's rows with: its tokenizer's pad token, else its EOS."""
    return tokenizer.pad_token_id or tokenizer.eos_token_id
