"""The sync controller loop of one run: roll out, score, train, push weights, evaluate,
checkpoint; repeat.

    setup     model, data, weight-sync group; resume from the last checkpoint;
              push the starting weights so the engine serves exactly the trainer's policy
    step      rollout (Generate n samples per prompt, scored) -> [dynamic sampling refills]
              -> train (recompute logprobs [and values], advantages, PPO epochs over the
              critic [with gae] and the policy) -> push -> [eval] -> [checkpoint]

Model compute runs through `Ranks` (trainer_svc/ranks.py), on every rank of the trainer service
and in a worker thread, so the service keeps answering RPCs (GetRun, StopRun) during a step.
Every stage reports a ProgressEvent through `emit`. `RunLoop` (trainer_svc/run_loop.py) holds
what this loop shares with the SFT loop (trainer_svc/sft.py): stop and checkpoint requests, the
report, the end of the run.
"""

import logging
import time
from dataclasses import replace
from typing import Any

import torch

from trainer_svc.data import EpochSampler, PromptRecord, load_datasets
from trainer_svc.ranks import checkpoint_state, gather_weights
from trainer_svc.report import REWARD_PLOT
from trainer_svc.rl_step import (
    keep_groups_with_signal,
    mini_batches,
    rl_models,
    rl_update,
    rollout_batch,
    rollout_metrics,
    trainable,
)
from trainer_svc.run_loop import FINAL_MODEL, ProgressEvent, RunLoop
from trainer_svc.weight_push import WeightPusher
from turnrl import rpc
from turnrl.trajectory import Trajectory
from turnrl.v1 import common_pb2, rollout_pb2, rollout_pb2_grpc

logger = logging.getLogger(__name__)
MIB = 1024 * 1024


class Controller(RunLoop):
    """Runs one RL run to its end, or until `request_stop`."""

    async def run(self, resume: bool) -> dict[str, Any]:
        """Trains to `config.steps` or a stop; returns the summary written to summary.json."""
        started = time.monotonic()
        config = self.config
        model_path, _ = await self._model_and_tokenizer()
        await self.ranks.build(rl_models, config, model_path)
        train, self.held_out = load_datasets(config.data, config.seed)
        self.sampler = EpochSampler(train, config.seed, config.data.shuffle)
        self.generator = torch.Generator().manual_seed(config.seed)
        state = await self._restore_checkpoint() if resume else None
        if state is not None:
            self.generator.set_state(state["generator"])
        self._open_report(state is not None, REWARD_PLOT)
        async with rpc.open_channel(config.rollout_service) as rollout_channel:
            self.rollout = rollout_pb2_grpc.RolloutServiceStub(rollout_channel)
            self.pusher = await WeightPusher.connect(
                [self.rollout],
                backend=config.weight_sync.backend,
                master_address=config.weight_sync.master_address,
                group_name=f"turnrl-{self.run_dir.name}",
                timeout_seconds=config.weight_sync.timeout_seconds,
                mode=config.weight_sync.mode,
            )
            self._policy_version = 0  # the last weight version pushed
            try:
                await self._push()
                self.emit(ProgressEvent(self.step, "setup", message=f"model {model_path}"))
                await self._train_to_end()
            finally:
                self.pusher.close()
        return await self._finish(model_path, started)

    async def _train_step(self) -> None:
        self.step += 1
        timings: dict[str, float] = {}
        started = time.monotonic()
        trajectories = await self._rollout()
        timings["time/rollout"] = time.monotonic() - started
        rollouts = rollout_batch(trajectories, self.pad_token_id)
        metrics = {f"rollout/{k}": v for k, v in rollout_metrics(trajectories).items()}
        generated = int(rollouts.batch.loss_mask.sum())
        metrics["rollout/tokens_per_s"] = generated / max(timings["time/rollout"], 1e-9)
        self.emit(ProgressEvent(self.step, "rollout", metrics))

        started = time.monotonic()
        algorithm = self.config.algorithm
        rows = [
            mini
            for _ in range(algorithm.ppo_epochs)
            for mini in mini_batches(len(trajectories), algorithm.mini_batches, self.generator)
        ]
        # The trajectories stay here: the ranks need the tensors only.
        tensors = replace(rollouts, trajectories=[])
        metrics.update(await self.ranks.run(rl_update, tensors, self.config, self.step, rows))
        timings["time/train"] = time.monotonic() - started
        tokens = int(rollouts.batch.attention_mask.sum()) * self.config.algorithm.ppo_epochs
        metrics["train/tokens_per_s"] = tokens / timings["time/train"]
        self.emit(ProgressEvent(self.step, "train", metrics))

        started = time.monotonic()
        await self._push()
        timings["time/push"] = time.monotonic() - started
        self.emit(ProgressEvent(self.step, "push", {"time/push": timings["time/push"]}))
        self.report.log(self.step, {**metrics, **timings})
        await self._evaluate_and_checkpoint_when_due()

    async def _rollout(self) -> list[Trajectory]:
        """One batch of scored trajectories; with dynamic sampling, groups that teach nothing
        are dropped and more prompts rolled out, up to `max_refills` times."""
        algorithm = self.config.algorithm
        wanted = self.config.rollout.prompts_per_step * self.config.rollout.samples_per_prompt
        kept: list[Trajectory] = []
        for attempt in range(1 + (algorithm.max_refills if algorithm.dynamic_sampling else 0)):
            records = self.sampler.next_batch(self.config.rollout.prompts_per_step)
            found = await self._generate(records, f"step{self.step}.{attempt}", training=True)
            found = [t for t in found if trainable(t)]
            kept += keep_groups_with_signal(found) if algorithm.dynamic_sampling else found
            if len(kept) >= wanted:
                break
        if not kept:
            raise RuntimeError(
                f"step {self.step}: no trajectory to train on (all groups had equal rewards or "
                "no model tokens); raise algorithm.max_refills or check the rollout service"
            )
        return kept[:wanted]

    async def _generate(
        self, records: list[PromptRecord], tag: str, *, training: bool
    ) -> list[Trajectory]:
        request_config = self.config.rollout
        prompts = [r.to_proto(self.config.rollout.tools) for r in records]
        for index, prompt in enumerate(prompts):
            prompt.prompt_id = f"{index}:{prompt.prompt_id}"  # a record may recur in a batch
        sampling = (
            common_pb2.SamplingParams(
                temperature=request_config.temperature,
                top_p=request_config.top_p,
                seed=self.config.seed * 1_000_003 + self.step,
            )
            if training
            else common_pb2.SamplingParams(temperature=0.0)
        )
        request = rollout_pb2.GenerateRequest(
            prompts=prompts,
            n=request_config.samples_per_prompt if training else 1,
            sampling=sampling,
            limits=common_pb2.LengthLimits(
                max_new_tokens=request_config.max_new_tokens,
                max_response_length=request_config.max_response_length,
            ),
            max_turns=request_config.max_turns,
            enable_scoring=True,
            request_id=f"{self.run_dir.name}/{tag}",
        )
        replies = self.rollout.Generate(request, timeout=request_config.timeout_seconds)
        trajectories = [Trajectory.from_proto(reply.trajectory) async for reply in replies]
        # They stream back as they finish; a fixed order keeps mini-batches (and a resumed run)
        # reproducible.
        return sorted(trajectories, key=lambda t: t.trajectory_id)

    async def _push(self) -> None:
        """Sends the policy's weights as the next version the engine has not seen."""
        stats = await self.rollout.GetStats(rollout_pb2.GetStatsRequest(), timeout=30)
        self._policy_version = max(self._policy_version, stats.policy_version) + 1
        bucket_size_bytes = self.config.weight_sync.bucket_size_mb * MIB
        weights = await self.ranks.run(gather_weights, bucket_size_bytes)
        await self.pusher.push(weights, self._policy_version)

    async def _evaluate(self) -> None:
        if not self.held_out:
            return
        started = time.monotonic()
        trajectories = await self._generate(self.held_out, f"eval{self.step}", training=False)
        measured = rollout_metrics(trajectories)
        metrics = {
            "eval/accuracy": measured["accuracy"],
            "eval/pass@1": measured["accuracy"],
            "eval/reward_mean": measured["reward_mean"],
            "eval/tool_calls": measured["tool_calls"],
            "eval/step": float(self.step),
            "time/eval": time.monotonic() - started,
        }
        self.report.log(self.step, metrics)
        message = f"held-out accuracy {measured['accuracy']:.3f} on {len(trajectories)} prompts"
        self.emit(ProgressEvent(self.step, "eval", metrics, message))

    async def _checkpoint(self) -> None:
        state = await self.ranks.run(checkpoint_state)
        state["data_position"] = self.sampler.position
        state["generator"] = self.generator.get_state()
        await self._save_checkpoint(state)

    def _summary(self, wall_seconds: float) -> dict[str, Any]:
        report = self.report
        return {
            "run_name": self.run_dir.name,
            "steps": self.step,
            "stopped_early": self.step < self.config.steps,
            "initial_eval_accuracy": report.first("eval/accuracy"),
            "final_eval_accuracy": report.last("eval/accuracy"),
            "initial_train_reward": report.first("rollout/reward_mean"),
            "final_train_reward": report.last("rollout/reward_mean"),
            "logprob_mismatch_mean_abs": report.last("mismatch/mean_abs_diff"),
            "wall_seconds": round(wall_seconds, 1),
            "final_model": str(self.run_dir / FINAL_MODEL),
        }
