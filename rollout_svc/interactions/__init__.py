"""Built-in interactions (simulated users), by the name a config's `class_name` uses."""

from rollout_svc.interactions.base import Interaction
from rollout_svc.interactions.gsm8k import Gsm8kInteraction
from rollout_svc.interactions.llm_user import LlmUser

INTERACTIONS: dict[str, type[Interaction]] = {
    "gsm8k": Gsm8kInteraction,
    "llm_user": LlmUser,
}
