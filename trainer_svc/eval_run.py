"""An evaluation run (`trainer.mode: eval`, `turnrl eval`): the RL loop's held-out evaluation
(`Controller._evaluate`, with `trainer.eval`'s sampling and pass@k), once, of the model the
rollout service serves. Nothing is trained, pushed or checkpointed: the trainer builds no model;
the run's folder gets eval/step_000000.jsonl (the generations), metrics.jsonl and summary.json
(the metrics, overall and per data source)."""

import asyncio
import time
from typing import Any

from trainer_svc.controller import Controller
from trainer_svc.data import load_datasets
from trainer_svc.dumps import DumpWriter
from trainer_svc.report import REWARD_PLOT
from trainer_svc.run_loop import ProgressEvent
from trainer_svc.served_model import ServedModel
from turnrl.errors import ConfigError


class EvalRun(Controller):
    """Evaluates the served model on the held-out data once; its step stays 0."""

    def _planned_steps(self) -> int:
        return 0

    async def run(self, resume: bool, resume_from: str | None = None) -> dict[str, Any]:
        started = time.monotonic()
        config = self.config
        _, self.held_out = await asyncio.to_thread(load_datasets, config.data, config.seed)
        if not self.held_out:
            raise ConfigError(
                "an evaluation run has no held-out prompts: name them in "
                "trainer.data.eval_files (or leave train_files and eval_files empty for the "
                "generated task's test split)"
            )
        _, tokenizer = await self._model_and_tokenizer()
        await self._open_report(False, REWARD_PLOT)
        # The rollout service serves the model it loaded, as weight version 0, which nothing
        # pushes: a replica that comes back has it again (its catch-up finds nothing to send).
        self.served_policy = ServedModel(
            "policy", self.ranks, config.rollout_service, config.weight_sync, "unused"
        )
        self.dumps = DumpWriter(tokenizer)
        try:
            self.emit(ProgressEvent(0, "setup", message=f"evaluating {config.model_path}"))
            await self._evaluate()
        finally:
            await self.served_policy.close()
            await asyncio.to_thread(self.dumps.close)
        summary = await asyncio.to_thread(
            self.report.finish, self._summary(time.monotonic() - started)
        )
        self.emit(ProgressEvent(0, "done", message=f"summary {self.run_dir}/summary.json"))
        return summary

    def _summary(self, wall_seconds: float) -> dict[str, Any]:
        measured = {k: v for k, v in self.report.history[-1].items() if k.startswith("eval/")}
        return {
            "run_name": self.run_dir.name,
            "model": self.config.model_path,
            "held_out_prompts": len(self.held_out),
            "samples_per_prompt": self.config.eval.n,
            **measured,
            "wall_seconds": round(wall_seconds, 1),
        }
