"""The sync controller loop of one run (`trainer.loop: sync`): roll out, score, train, push
weights, evaluate, checkpoint; repeat. The async loop (trainer_svc/async_controller.py) is this
one with another `_rollout`.

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

import asyncio
import functools
import logging
import random
import time
import uuid
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch
from transformers import AutoTokenizer

from trainer_svc.batch import mini_batches
from trainer_svc.data import EpochSampler, PromptRecord, load_datasets
from trainer_svc.dumps import (
    EVAL_FOLDER,
    ROLLOUTS_FOLDER,
    DumpWriter,
    dump_path,
    rollout_records,
    select_for_dump,
    trajectory_record,
)
from trainer_svc.eval_metrics import sampled_metrics
from trainer_svc.judge_training import (
    is_judge,
    judge_metrics,
    judge_records,
    judge_update,
    judged_policy,
    judges_by_policy,
    ran_ok,
)
from trainer_svc.ledger import PromptLedger, prompt_key
from trainer_svc.report import REWARD_PLOT
from trainer_svc.rl_step import (
    RolloutBatch,
    infra_failed,
    keep_groups_with_signal,
    rl_models,
    rl_update,
    rollout_batch,
    rollout_metrics,
    staleness_metrics,
    trainable,
)
from trainer_svc.rollout_router import RolloutRouter, engine_metrics
from trainer_svc.run_loop import FINAL_MODEL, ProgressEvent, RunLoop, pad_token_id
from trainer_svc.served_model import ServedModel
from trainer_svc.weight_push import PushResult
from turnrl.trajectory import Trajectory
from turnrl.v1 import common_pb2, rollout_pb2

logger = logging.getLogger(__name__)


class Controller(RunLoop):
    """Runs one RL run to its end, or until `request_stop`."""

    @functools.cached_property
    def _calls(self) -> str:
        """The mark of this trainer process's Generate request ids: a resumed run's never
        collide with calls of the killed one that the rollout service may still be ending."""
        return uuid.uuid4().hex[:8]

    async def run(self, resume: bool, resume_from: str | None = None) -> dict[str, Any]:
        """Trains to `config.steps` or a stop; returns the summary written to summary.json."""
        started = time.monotonic()
        config = self.config
        model_path, tokenizer = await self._model_and_tokenizer()
        await self.ranks.build(rl_models, config, model_path)
        train, self.held_out = await asyncio.to_thread(load_datasets, config.data, config.seed)
        self.sampler = EpochSampler(train, config.seed, config.data.shuffle)
        self.generator = torch.Generator().manual_seed(config.seed)
        self.ledger = PromptLedger(self.run_dir)
        state = await self._restore_checkpoint(resume_from) if resume else None
        if state is not None:
            self._resume_from(state)
        # What the restored model trained on, only: a run resumed with no checkpoint yet (its
        # trainer died before the first) starts its ledger again.
        self.ledger.rewind(self.step)
        await self._open_report(state is not None, REWARD_PLOT)
        await self._open_hub_repo()
        groups = f"turnrl-{self.run_dir.name}"  # the weight-sync groups' names
        self.served_policy = ServedModel(
            "policy", self.ranks, config.rollout_service, config.weight_sync, groups, config.lora
        )
        # A co-trained judge of its own (judge_training.model_path), on replicas of its own.
        self.served_judge: ServedModel | None = None
        if config.judge_model_path is not None:
            self.served_judge = ServedModel(
                "judge", self.ranks, config.judge_training.rollout_service, config.weight_sync,
                f"{groups}-judge",
            )  # fmt: skip
            judge_tokenizer = await asyncio.to_thread(
                AutoTokenizer.from_pretrained, config.judge_model_path
            )
            self.judge_pad_token_id = pad_token_id(judge_tokenizer)
        self.dumps = DumpWriter(tokenizer)
        try:
            await self._push()
            self.emit(ProgressEvent(self.step, "setup", message=f"model {model_path}"))
            await self._train_to_end()
        finally:
            await self.served_policy.close()
            if self.served_judge is not None:
                await self.served_judge.close()
            await asyncio.to_thread(self.dumps.close)
        return await self._finish(model_path, started)

    @property
    def router(self) -> RolloutRouter:
        """The policy's rollout replicas' router."""
        return self.served_policy.router

    @property
    def _policy_version(self) -> int:
        """The last weight version of the policy pushed."""
        return self.served_policy.version

    def _resume_from(self, state: dict[str, Any]) -> None:
        """Continues the loop's own state from a checkpoint (the models, the step and the data
        position are restored already)."""
        self.generator.set_state(state["generator"])

    async def _train_step(self) -> None:
        self.step += 1
        trajectories, metrics = await self._rollout()
        policy = [t for t in trajectories if not is_judge(t)]  # a co-trained judge's: judge/*
        # The verdicts train with the policy's model, unless the judge is a model of its own.
        own_judge = [t for t in trajectories if is_judge(t)] if self.served_judge else []
        trained = policy if self.served_judge else trajectories
        rollouts = rollout_batch(trained, self.pad_token_id, self._policy_version, self.vision)
        metrics.update({f"rollout/{k}": v for k, v in rollout_metrics(policy).items()})
        metrics.update(staleness_metrics(trained, self._policy_version))
        self.emit(ProgressEvent(self.step, "rollout", metrics))

        await self._train(rollouts, metrics)
        if own_judge:
            await self._train_judge(own_judge, metrics)
        started = time.monotonic()
        self._dump_rollouts(rollouts)
        metrics["time/dumps"] = time.monotonic() - started  # the hand-off; the writing is off-loop
        # The writer's CPU time since the last step (its JSON holds the GIL the loop needs).
        metrics["time/dumps_writer_cpu"] = self.dumps.take_cpu_seconds()
        started = time.monotonic()
        pushed = await self._push()
        metrics["time/push"] = time.monotonic() - started
        metrics["time/push_stall"] = pushed.seconds  # generation paused, Pause to Resume
        # 0 when no weight-sync group formed and the weights went as gRPC streams (slower).
        metrics["push/broadcast"] = float(pushed.mode == "broadcast")
        metrics["push/bytes"] = float(pushed.total_bytes)  # the adapters' alone, under LoRA
        self.emit(ProgressEvent(self.step, "push", {"time/push": metrics["time/push"]}))
        # The engine's own gauges and running totals (busy seconds, tokens, cache hits), as
        # the rollout service reports them.
        metrics.update(engine_metrics(await self.router.stats()))
        metrics["router/live_replicas"] = float(len(self.router.live()))
        metrics["router/redispatched_groups"] = float(self.router.redispatched_groups)
        self.report.log(self.step, metrics)
        await self._finish_step()

    async def _train(self, rollouts: RolloutBatch, metrics: dict[str, float]) -> None:
        """The update of one step on `rollouts` (on every rank); adds its metrics to `metrics`."""
        started = time.monotonic()
        metrics.update(await self._update(rl_update, rollouts))
        metrics["time/train"] = time.monotonic() - started
        tokens = int(rollouts.batch.attention_mask.sum()) * self.config.algorithm.ppo_epochs
        metrics["train/tokens_per_s"] = tokens / metrics["time/train"]
        self.emit(ProgressEvent(self.step, "train", metrics))

    async def _train_judge(self, judges: list[Trajectory], metrics: dict[str, float]) -> None:
        """The update of a judge of its own on its verdicts `judges` (on every rank), after
        the policy's; adds its metrics (judge_train/..., judge_mismatch/...) to `metrics`."""
        started = time.monotonic()
        rollouts = rollout_batch(judges, self.judge_pad_token_id, self.served_judge.version)
        metrics.update(await self._update(judge_update, rollouts))
        metrics["time/judge_train"] = time.monotonic() - started

    async def _update(self, update: Callable[..., dict[str, float]], rollouts: RolloutBatch):
        """`update(models, tensors, config, step, rows)` on every rank (`rl_update` or
        `judge_update`): the PPO epochs' mini-batches of `rollouts`' rows, in the run's
        seeded order; its metrics."""
        algorithm = self.config.algorithm
        rows = [
            mini
            for _ in range(algorithm.ppo_epochs)
            for mini in mini_batches(len(rollouts.rewards), algorithm.mini_batches, self.generator)
        ]
        # The trajectories stay here: the ranks need the tensors only.
        tensors = replace(rollouts, trajectories=[])
        return await self.ranks.run(update, tensors, self.config, self.step, rows)

    def _dump_rollouts(self, rollouts: RolloutBatch) -> None:
        """Hands the trained step's sample of trajectories (`trainer.dumps`) to the writer: after
        `_train`, whose `prepare_update` added the trainer's logprobs and the advantages to the
        batch (rank 0 computes in this process, on this very batch)."""
        settings = self.config.dumps
        if settings.rollouts_per_step == 0:
            return
        chosen = select_for_dump(
            [t.reward.score for t in rollouts.trajectories],
            [t.group_id for t in rollouts.trajectories],
            settings.rollouts_per_step,
            settings.extreme_groups,
            random.Random(self.config.seed * 1_000_003 + self.step),
        )
        path = dump_path(self.run_dir, ROLLOUTS_FOLDER, self.step)
        records = functools.partial(
            rollout_records, rollouts, chosen, self.step, self._policy_version
        )
        self.dumps.write(path, records)

    async def _rollout(self) -> tuple[list[Trajectory], dict[str, float]]:
        """One batch of scored, usable trajectories (`trainable`), and the rollout's timing;
        with dynamic sampling, groups that teach nothing are dropped and more prompts rolled
        out, up to `max_refills` times. Writes the step's line of the prompt ledger."""
        started = time.monotonic()
        algorithm = self.config.algorithm
        groups_per_step = self.config.rollout.prompts_per_step
        kept: list[Trajectory] = []
        judges: list[Trajectory] = []  # with trainer.judge_training: the verdicts on `kept`
        drawn: list[str] = []
        infra_failures = 0
        metrics: dict[str, float] = {}
        for attempt in range(1 + (algorithm.max_refills if algorithm.dynamic_sampling else 0)):
            positions = self.sampler.next_positions(groups_per_step)
            records = [self.sampler.record_at(p) for p in positions]
            keys = [prompt_key(p, r.prompt_id) for p, r in zip(positions, records, strict=True)]
            drawn += keys
            tag = f"step{self.step}.{attempt}"
            found = await self._generate(records, keys, tag, training=True)
            infra_failures += sum(map(infra_failed, found))
            found = [t for t in found if trainable(t)]
            if self.config.judge_training is not None:
                verdicts = await self._judge(found, f"{tag}.judge", training=True)
                judged = judged_policy(found, verdicts, self.config.judge_training)
                found, judges = judged.policy, judges + judged.judges
                for name, count in judged.counts().items():
                    metrics[name] = metrics.get(name, 0.0) + count
            kept += (
                keep_groups_with_signal(found, enable_turn_rewards=algorithm.enable_turn_rewards)
                if algorithm.dynamic_sampling
                else found
            )
            if len({t.group_id for t in kept}) >= groups_per_step:
                break
        if not kept:
            raise RuntimeError(
                f"step {self.step}: no trajectory to train on (all groups had equal rewards or "
                "no usable model tokens); raise algorithm.max_refills or check the rollout service"
            )
        kept_groups = list(dict.fromkeys(t.group_id for t in kept))
        trained = kept_groups[:groups_per_step]
        self.ledger.record(
            self.step,
            trained=trained,
            filtered=[key for key in drawn if key not in kept_groups],
            unused=kept_groups[groups_per_step:],
        )
        batch = [t for t in kept if t.group_id in trained]
        if self.config.judge_training is not None:
            batch += self._judges_to_train(batch, judges, metrics)
        seconds = time.monotonic() - started
        generated = sum(t.metrics["model_tokens"] for t in kept + judges)
        return batch, {
            **metrics,
            "time/rollout": seconds,
            "rollout/tokens_per_s": generated / seconds,
            "rollout/infra_failed_trajectories": float(infra_failures),
        }

    async def _judge(
        self, policy: list[Trajectory], tag: str, *, training: bool
    ) -> list[Trajectory]:
        """The verdicts of the policy's own model on `policy` (`trainer.judge_training`), in
        trajectory id order: training, `samples` on each at the judge's temperature;
        evaluating, one at the held-out evaluation's."""
        settings = self.config.judge_training
        records = judge_records(policy, settings)
        sampled = settings if training else self.config.eval
        request = rollout_pb2.GenerateRequest(
            prompts=[record.to_proto([]) for record in records],
            n=settings.samples if training else 1,
            sampling=common_pb2.SamplingParams(
                temperature=sampled.temperature,
                top_p=1.0 if training else self.config.eval.top_p,
                seed=self._sampling_seed(training=training),
            ),
            limits=common_pb2.LengthLimits(max_new_tokens=settings.max_new_tokens),
            max_turns=1,
            enable_scoring=True,
            request_id=f"{self.run_dir.name}/{self._calls}/{tag}",
        )
        served = self.served_judge or self.served_policy
        judges = await served.router.generate(
            request, timeout_seconds=self.config.rollout.timeout_seconds
        )
        return sorted(judges, key=lambda t: t.trajectory_id)

    def _judges_to_train(
        self, policy: list[Trajectory], judges: list[Trajectory], metrics: dict[str, float]
    ) -> list[Trajectory]:
        """The trainable verdicts on the trained `policy` (with dynamic sampling, in groups
        whose verdicts differ); adds how the judges did to `metrics` (judge/...)."""
        judged = judges_by_policy(policy, judges)
        ran = [j for t in policy for j in judged[t.trajectory_id]]
        metrics.update({f"judge/{k}": v for k, v in judge_metrics(policy, ran).items()})
        usable = [j for j in ran if trainable(j)]
        if self.config.algorithm.dynamic_sampling:
            usable = keep_groups_with_signal(usable, enable_turn_rewards=False)
        metrics["judge/trained_trajectories"] = float(len(usable))
        return usable

    async def _generate(
        self, records: list[PromptRecord], prompt_ids: list[str], tag: str, *, training: bool
    ) -> list[Trajectory]:
        """The trajectories of `records` (their groups named `prompt_ids`, unique in the call),
        in trajectory id order."""
        trajectories = await self.router.generate(
            self._generate_request(records, prompt_ids, tag, training=training),
            timeout_seconds=self.config.rollout.timeout_seconds,
        )
        # They stream back as they finish; a fixed order keeps mini-batches (and a resumed run)
        # reproducible.
        return sorted(trajectories, key=lambda t: t.trajectory_id)

    def _generate_request(
        self, records: list[PromptRecord], prompt_ids: list[str], tag: str, *, training: bool
    ) -> rollout_pb2.GenerateRequest:
        """A Generate call for `records`: training samples `rollout.samples_per_prompt` each,
        evaluation `eval.n` each (greedy unless `trainer.eval` says otherwise)."""
        request_config = self.config.rollout
        prompts = [r.to_proto(request_config.tools) for r in records]
        for prompt, prompt_id in zip(prompts, prompt_ids, strict=True):
            prompt.prompt_id = prompt_id
            prompt.chat_template_kwargs.update(self.config.data.chat_template_kwargs)
        sampled = request_config if training else self.config.eval
        sampling = common_pb2.SamplingParams(
            temperature=sampled.temperature,
            top_p=sampled.top_p,
            seed=self._sampling_seed(training=training),
        )
        return rollout_pb2.GenerateRequest(
            prompts=prompts,
            n=request_config.samples_per_prompt if training else self.config.eval.n,
            sampling=sampling,
            limits=common_pb2.LengthLimits(
                max_new_tokens=request_config.max_new_tokens,
                max_response_length=request_config.max_response_length,
            ),
            max_turns=request_config.max_turns,
            enable_scoring=True,
            request_id=f"{self.run_dir.name}/{self._calls}/{tag}",
        )

    def _sampling_seed(self, *, training: bool) -> int:
        """The seed of this step's Generate calls: an evaluation's own seeds, apart from the
        training step's of the same number."""
        return self.config.seed * 1_000_003 + self.step + (0 if training else 500_009)

    async def _push(self) -> PushResult:
        """Pushes the policy's weights to its replicas, and a judge of its own's to its
        replicas; the policy's push's figures."""
        pushed = await self.served_policy.push()
        if self.served_judge is not None:
            await self.served_judge.push()
        return pushed

    async def _evaluate(self) -> None:
        if not self.held_out:
            return
        started = time.monotonic()
        prompt_ids = [f"{i}:{r.prompt_id}" for i, r in enumerate(self.held_out)]
        trajectories = await self._generate(
            self.held_out, prompt_ids, f"eval{self.step}", training=False
        )
        if self.config.dumps.enable_eval:
            step, version = self.step, self._policy_version
            self.dumps.write(
                dump_path(self.run_dir, EVAL_FOLDER, step),
                lambda: [trajectory_record(t, step, version) for t in trajectories],
            )
        usable = [t for t in trajectories if not infra_failed(t)]
        if not usable:
            raise RuntimeError(
                f"held-out evaluation at step {self.step}: every trajectory hit a tool or reward "
                "call that could not run, or its agent failed; check the tool and reward "
                "services (and rollout.agent: the rollout service's log names each failure)"
            )
        measured = rollout_metrics(usable)
        metrics = {
            # An answer lost to a dead service is not a wrong answer: it counts here only.
            "eval/infra_failed_trajectories": float(len(trajectories) - len(usable)),
            "eval/accuracy": measured["accuracy"],
            "eval/reward_mean": measured["reward_mean"],
            "eval/tool_calls": measured["tool_calls"],
            "eval/tool_call_share": measured["tool_call_share"],
            **sampled_metrics(usable, self.config.eval),
            "eval/step": float(self.step),
            "time/eval": time.monotonic() - started,
        }
        if self.config.judge_training is not None:
            verdicts = await self._judge(usable, f"eval{self.step}.judge", training=False)
            ran = [j for j in verdicts if ran_ok(j)]
            metrics["eval/judge_infra_failed_verdicts"] = float(len(verdicts) - len(ran))
            metrics.update({f"eval/judge_{k}": v for k, v in judge_metrics(usable, ran).items()})
        # A held-out set of several datasets (Search-R1's NQ and HotpotQA) is reported by each.
        sources = sorted({t.data_source for t in usable})
        if len(sources) > 1:
            for source in sources:
                of_source = [t for t in usable if t.data_source == source]
                metrics[f"eval/accuracy/{source}"] = rollout_metrics(of_source)["accuracy"]
        self.report.log(self.step, metrics)
        message = (
            f"held-out accuracy {measured['accuracy']:.3f} on {len(self.held_out)} prompts x "
            f"{self.config.eval.n} samples"
        )
        self.emit(ProgressEvent(self.step, "eval", metrics, message))

    async def _checkpoint(self) -> None:
        # The loop's state is taken here, with no await before it is stored, so it is the
        # loop's at one moment of the event loop.
        generator = {"generator": self.generator.get_state()}
        await self._save_checkpoint(generator, self._loop_state())

    def _loop_state(self) -> dict[str, Any]:
        """What a checkpoint holds of the loop beside the models and the mini-batch order's
        generator, as JSON values: the data position."""
        return {"data_position": self.sampler.position}

    def _summary(self, wall_seconds: float) -> dict[str, Any]:
        report = self.report
        return {
            "run_name": self.run_dir.name,
            "steps": self.step,
            "stopped_early": self.step < self.config.steps,
            "initial_eval_accuracy": report.first("eval/accuracy"),
            "final_eval_accuracy": report.last("eval/accuracy"),
            "initial_eval_tool_call_share": report.first("eval/tool_call_share"),
            "final_eval_tool_call_share": report.last("eval/tool_call_share"),
            "initial_train_reward": report.first("rollout/reward_mean"),
            "final_train_reward": report.last("rollout/reward_mean"),
            "logprob_mismatch_mean_abs": report.last("mismatch/mean_abs_diff"),
            "wall_seconds": round(wall_seconds, 1),
            "final_model": str(self.run_dir / FINAL_MODEL),
        }
