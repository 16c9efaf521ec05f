"""Agent episodes: the rollout mode in which a user's agent (`rollout.agent`), not the built-in
agent loop, plays each sample of a Generate call (issue 31: agents written elsewhere, trained
unchanged).

For each sample the service opens a gateway session with the call's sampling and limits
(`ChatSessions.open`), runs the agent on the prompt with that session's base URL
(`AgentRunner`: a callable agent is forked from one fork server that imported it once, started
at the first episode and stopped by `close`), closes the session when the agent ends (aborting
a request it left running) and takes the session's token-exact trajectory. The trajectory is
then scored: by the reward the agent returned, else by the reward service on the agent's answer
(else its last assistant message), as the agent loop scores its own.

How an episode ends, and whether it trains (DESIGN.md "Failures": what the model caused is
scored; what the system caused is excluded and counted):
| the agent ...                                   | trajectory                                |
| returned a result                               | the session's finish reason, scored       |
| failed after a request ran into a limit         | that limit's finish reason, scored: the   |
|   (max_turns, max_response_length, ...) or its  | model ran long, not the system            |
|   last turn was cut by max_new_tokens           |                                           |
| failed otherwise (`AgentFailure`)               | ERROR, excluded; counted per kind in stats|
| made no request                                 | ERROR, excluded; counted                  |
| was aborted (the Generate call's Abort)         | ABORTED with the tokens so far, excluded  |
"""

import asyncio
import dataclasses
import logging
import uuid

from rollout_svc.agent_loop import AgentLoop, PromptSpec, RolloutLimits
from rollout_svc.agent_runner import AgentOutcome, AgentRunner
from rollout_svc.engines.base import SamplingParams
from rollout_svc.gateway.session_state import EpisodeSettings, session_metrics
from rollout_svc.gateway.sessions import ChatSessions
from turnrl.trajectory import FinishReason, Trajectory
from turnrl.v1 import common_pb2

log = logging.getLogger(__name__)

# What an episode that made no request counts as in the service's stats.
NO_REQUEST = "agent_made_no_request"


class AgentEpisodes:
    """Runs a Generate call's samples as episodes of the user's agent through the gateway at
    `gateway_url`, which takes `api_key` as its bearer token."""

    def __init__(
        self,
        runner: AgentRunner,
        sessions: ChatSessions,
        loop: AgentLoop,
        gateway_url: str,
        api_key: str,
    ) -> None:
        self._runner = runner
        self._sessions = sessions
        self._loop = loop  # its reward service client scores the episodes
        self._gateway_url = gateway_url
        self._api_key = api_key
        self._agents: dict[str, set[asyncio.Task]] = {}  # request_id -> running agents
        self.failures: dict[str, float] = {}  # per AgentFailure value (and NO_REQUEST)

    async def run(
        self,
        prompt: PromptSpec,
        sample_index: int,
        sampling: SamplingParams,
        limits: RolloutLimits,
        enable_scoring: bool,
        request_id: str,
    ) -> Trajectory:
        """Plays one sample of `prompt` with the agent; never raises for the episode's sake.
        Cancelled (the call's stream ended), it kills the agent and closes the session."""
        session_id = f"episode-{uuid.uuid4().hex}"
        self._sessions.open(session_id, EpisodeSettings(sampling, limits))
        agent = asyncio.create_task(
            self._runner.run(
                dataclasses.asdict(prompt),
                f"{self._gateway_url}/sessions/{session_id}/v1",
                self._api_key,
            )
        )
        running = self._agents.setdefault(request_id, set())
        running.add(agent)
        outcome: AgentOutcome | None = None
        try:
            outcome = await agent
        except asyncio.CancelledError:
            if asyncio.current_task().cancelling():  # this episode's caller, not `abort`
                raise
        finally:
            running.discard(agent)
            agent.cancel()  # kills the agent's process group, when this episode is cancelled
            await asyncio.wait([agent])
            recorded = await asyncio.shield(self._sessions.close(session_id))
        trajectory = self._trajectory(prompt, sample_index, recorded)
        if outcome is None:
            trajectory.finish_reason = FinishReason.ABORTED
            return trajectory
        trajectory.metrics["agent_seconds"] = outcome.seconds
        if outcome.failure is not None and not _limit_reached(trajectory):
            return self._failed(trajectory, outcome.failure.value, outcome.error_message, outcome)
        if recorded is None:
            return self._failed(trajectory, NO_REQUEST, "the agent made no request", outcome)
        if outcome.reward is not None:
            trajectory.reward = common_pb2.Reward(score=outcome.reward)
            trajectory.reward.extras.update({"source": "agent"})
        elif enable_scoring:
            await self._loop.score(prompt, trajectory, outcome.answer)
        return trajectory

    async def abort(self, request_id: str) -> None:
        """Ends the episodes of one Generate call now: their agents are killed and their
        trajectories come back ABORTED."""
        for agent in list(self._agents.get(request_id, ())):
            agent.cancel()

    def forget(self, request_id: str) -> None:
        """Drops the bookkeeping of a finished Generate call."""
        self._agents.pop(request_id, None)

    async def close(self) -> None:
        """Stops the agent's fork server; an episode still running fails."""
        await self._runner.close()

    def _trajectory(
        self, prompt: PromptSpec, sample_index: int, recorded: Trajectory | None
    ) -> Trajectory:
        """The session's trajectory under the sample's ids (an empty one without a request)."""
        trajectory = recorded or Trajectory(
            trajectory_id="",
            group_id="",
            sample_index=0,
            messages=list(prompt.messages),
            metrics=session_metrics([], 0, 0),
        )
        trajectory.trajectory_id = f"{prompt.prompt_id}/{sample_index}"
        trajectory.group_id = prompt.prompt_id
        trajectory.sample_index = sample_index
        trajectory.data_source = prompt.data_source
        return trajectory

    def _failed(
        self, trajectory: Trajectory, kind: str, message: str, outcome: AgentOutcome
    ) -> Trajectory:
        """The trajectory of an episode the system failed: ERROR, out of the loss, counted."""
        self.failures[kind] = self.failures.get(kind, 0.0) + 1
        log.warning(
            "agent episode %s failed (%s): %s; its stderr ends:\n%s",
            trajectory.trajectory_id,
            kind,
            message,
            outcome.stderr_tail,
        )
        trajectory.finish_reason = FinishReason.ERROR
        trajectory.error_message = f"{kind}: {message}"
        trajectory.metrics["agent_failed"] = 1.0  # the trainer's `infra_failed`: counted apart
        return trajectory


def _limit_reached(trajectory: Trajectory) -> bool:
    """Whether the session ended on a limit (the model's doing): one a request ran into, or
    max_new_tokens cutting the last turn (which the gateway refuses to continue)."""
    return trajectory.finish_reason in (
        FinishReason.MAX_NEW_TOKENS,
        FinishReason.MAX_TURNS,
        FinishReason.MAX_MODEL_LEN,
        FinishReason.MAX_RESPONSE_LENGTH,
    )
