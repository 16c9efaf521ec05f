"""The rollout service: request-level asynchronous multi-turn rollout on an inference engine."""
