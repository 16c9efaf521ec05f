"""The value model of PPO with GAE: the policy's transformer with a scalar head, sharded and
trained like the policy (`FsdpModel`), with its own optimizer settings.

The head is transformers' `...ForTokenClassification` with one label, the model verl's critic
uses too: the backbone loads from a causal LM folder, whose LM head is left out. A head the
folder lacks starts at zero, so the first values are 0 and the first advantages are plain
returns rather than a random head's noise. Dropout before the head is off: the values a step
trains are the ones `values` computed before it.
"""

from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor
from transformers import AutoConfig, AutoModelForTokenClassification

from trainer_svc.batch import Batch
from trainer_svc.config import TrainSettings
from trainer_svc.forward import packed_forward, unpacked
from trainer_svc.fsdp import FsdpModel, joins_process_group
from trainer_svc.sharded_load import load_model

# loss_fn(micro, values) -> (loss, metrics), the contract in trainer_svc.fsdp's docstring.
ValueLossFn = Callable[[Batch, Tensor], tuple[Tensor, dict[str, float]]]


class FsdpCritic(FsdpModel):
    """The critic: one value per token position, and its train step."""

    def __init__(self, model_path: str | Path, settings: TrainSettings) -> None:
        config = AutoConfig.from_pretrained(model_path, num_labels=1)
        config.classifier_dropout = 0.0
        loaded = load_model(
            AutoModelForTokenClassification, model_path, config, joins_process_group()
        )
        # The new head's weight and bias.
        zeros = {n: torch.zeros(loaded.model.get_parameter(n).shape) for n in loaded.missing}
        super().__init__(loaded, settings, fresh=zeros)

    def values(self, batch: Batch) -> Tensor:
        """V of each token's state, (rows, length) like the batch, on the batch's device.

        `values[:, t]` is the value of the prefix before token t, read from the head at position
        t - 1, as `FsdpPolicy.logprobs[:, t]` is the logprob of token t given that prefix: the
        state in which the policy chose token t. Column 0 and padding get 0. Every rank passes
        the same batch and computes its share of it (`FsdpModel._per_token`).
        """
        (values,) = self._per_token(batch, lambda micro: (self._forward(micro),))
        return values

    def train_step(self, batch: Batch, loss_fn: ValueLossFn) -> dict[str, float]:
        """One optimizer step on this rank's `batch` with loss_fn(micro, values); see
        `FsdpModel._train_step` for the metrics it returns."""
        return self._train_step(batch, lambda micro: loss_fn(micro, self._forward(micro)))

    def _forward(self, micro: Batch) -> Tensor:
        real = micro.attention_mask.bool()
        with self._autocast():
            if self.packs(micro):
                flat_ids = micro.input_ids[real][None]
                head, starts = packed_forward(self.model, flat_ids, micro.attention_mask)
                return unpacked(F.pad(head[0, :-1, 0].float(), (1, 0)), real, starts)
            head = self.model(
                input_ids=micro.input_ids, attention_mask=micro.attention_mask, use_cache=False
            ).logits
        values = F.pad(head[:, :-1, 0].float(), (1, 0))
        return values * real
