"""`gsm8k`: tells the model whether its final answer is right and lets it try again, as verl's
GSM8K interaction does. Needs `ground_truth` in the prompt's interaction_kwargs."""

from typing import Any, ClassVar

from pydantic import Field

from rollout_svc.interactions.base import Interaction, InteractionReply
from turnrl.answers import last_number
from turnrl.config import StrictModel


class Gsm8kInteractionOptions(StrictModel):
    """How many tries the model gets and what it is told."""

    max_attempts: int = Field(default=3, ge=1, description="Answers checked before giving up.")
    correct_text: str = Field(default="Your answer is correct!", description="Said when right.")
    retry_text: str = Field(
        default="Your answer is incorrect. Please check your work and try again.",
        description="Said when wrong and tries remain.",
    )


class Gsm8kInteraction(Interaction):
    """Checks the last number of the model's reply against the ground truth."""

    Options: ClassVar = Gsm8kInteractionOptions

    async def start(self, **interaction_kwargs: Any) -> dict[str, Any]:
        truth = last_number(str(interaction_kwargs.get("ground_truth", "")))
        if truth is None:
            raise ValueError(
                f"gsm8k interaction needs a numeric ground_truth; got {interaction_kwargs!r}"
            )
        return {"ground_truth": truth, "attempts": 0}

    async def respond(
        self, state: dict[str, Any], messages: list[dict[str, Any]]
    ) -> InteractionReply:
        options: Gsm8kInteractionOptions = self.options
        state["attempts"] += 1
        reply = messages[-1].get("content") or ""
        if last_number(reply if isinstance(reply, str) else "") == state["ground_truth"]:
            return InteractionReply(terminate=True, text=options.correct_text, score=1.0)
        out_of_tries = state["attempts"] >= options.max_attempts
        return InteractionReply(terminate=out_of_tries, text=options.retry_text, score=0.0)
