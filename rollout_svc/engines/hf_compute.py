"""The hf engine's model compute: loading the model, the running batch's KV and decode forward,
batched prefill (a vision-language model's on its images too: `hf_vision`), sampling (by
`hf_request.next_tokens`), and the weights' layout and updates. All of it runs on the engine's
worker thread, but for what the event loop reads: the vocabulary size, the EOS ids, the device
and the parameter shapes (`ModelRunner.check_shapes`), none of which a forward changes.

Running requests share one left-padded cache (`hf_cache.BatchKv`): row i holds its request's KV
right-aligned, a 2-D attention mask hides the padding and `position_ids` carry each row's true
position, so a row's numbers do not depend on its batch mates (up to float rounding). The price
is that every row attends over the longest row's width, the usual cost of padded batching. A
prefill batch pads the other way round, each row's cached prefix left and its new tokens right,
so its tokens are contiguous and every query attends to at least itself.
"""

from collections.abc import Iterable

import torch
from peft import LoraConfig, inject_adapter_in_model
from transformers import DynamicCache, PreTrainedModel
from transformers.cache_utils import DynamicLayer

from rollout_svc.engines.hf_cache import BatchKv, Kv
from rollout_svc.engines.hf_request import Request, next_tokens
from rollout_svc.engines.hf_vision import RequestVision, prefill_inputs
from turnrl.errors import FailedPreconditionError, InvalidArgumentError
from turnrl.vision import model_class
from turnrl.weights import PEFT_PREFIX, BucketedWeights, LoraAdapter, TensorMeta

# Requests admitted together whose prompts start alike (a system prompt) compute the common
# part once when it is at least this long.
MIN_SHARED_PREFIX_TOKENS = 32


def load_model(model_path: str, dtype: str, device: str) -> PreTrainedModel:
    """The causal LM in `model_path` (a vision-language one with its vision tower), on
    `device` in eval mode. Raises InvalidArgumentError for a model whose cache is not plain
    full attention (the only kind `BatchKv` holds)."""
    model = model_class(model_path).from_pretrained(model_path, dtype=getattr(torch, dtype))
    model = model.to(device).eval()
    layer_types = {type(layer).__name__ for layer in DynamicCache(config=model.config).layers}
    if layer_types != {DynamicLayer.__name__}:
        raise InvalidArgumentError(
            f"model {model_path!r} has cache layers {sorted(layer_types)!r}; the hf engine "
            "supports full-attention layers only (no sliding window or linear attention)"
        )
    return model


def eos_token_ids(model: PreTrainedModel) -> frozenset[int]:
    """EOS ids from the model's config and generation config (the latter lists the chat
    template's end-of-turn token too, e.g. Qwen's <|im_end|>)."""
    ids: set[int] = set()
    text_config = model.config.get_text_config()  # a VLM's is the text model's
    for value in (text_config.eos_token_id, model.generation_config.eos_token_id):
        if value is not None:
            ids.update([value] if isinstance(value, int) else value)
    return frozenset(ids)


class RunningBatch:
    """The running requests and their KV, row i of `kv` being requests[i]. Every request here has
    its last token (its prompt's last, or its latest sample) not yet fed:
    kv_len == len(token_ids) - 1."""

    def __init__(self, model: PreTrainedModel, max_rows: int, max_columns: int):
        self._model = model
        self._max_rows, self._max_columns = max_rows, max_columns
        self.requests: list[Request] = []
        self._kv_layout: Kv | None = None
        self._kv: BatchKv | None = None

    def kv_layout(self) -> Kv:
        """One token's KV per layer: the heads, head size, dtype and device of the model's KV,
        from a forward run on first use (in the worker thread)."""
        if self._kv_layout is None:
            cache = DynamicCache(config=self._model.config)
            input_ids = torch.zeros((1, 1), dtype=torch.long, device=self._model.device)
            self._model(input_ids=input_ids, cache=cache, use_cache=True)
            self._kv_layout = [(layer.keys, layer.values) for layer in cache.layers]
        return self._kv_layout

    def kv_bytes(self) -> int:
        return self._kv.nbytes() if self._kv is not None else 0

    def extend(self, joining: list[tuple[Request, Kv | None]]) -> None:
        """Adds requests with their own KV (None: none yet)."""
        if self._kv is None:
            self._kv = BatchKv(self.kv_layout(), self._max_rows, self._max_columns)
        self._kv.append([kv for _, kv in joining])
        self.requests += [request for request, _ in joining]

    def remove(self, rows: list[int]) -> list[tuple[Request, Kv]]:
        """Takes requests out; returns each with a copy of its KV, unpadded. The last rows move
        into the freed ones."""
        if not rows:
            return []
        width = self._kv.width
        removed = []
        for row in rows:
            request = self.requests[row]
            kv = self._kv.row_kv(row, slice(width - request.kv_len, width))
            removed.append((request, [(keys.clone(), values.clone()) for keys, values in kv]))
        kept = [request for row, request in enumerate(self.requests) if row not in rows]
        order = self._kv.remove(rows, max((request.kv_len for request in kept), default=0))
        self.requests = [self.requests[row] for row in order]
        return removed

    def clear(self) -> list[Request]:
        """Drops every request's KV; returns the requests."""
        requests, self.requests = self.requests, []
        if self._kv is not None:
            self._kv.clear()
        return requests

    def decode(self) -> torch.Tensor:
        """Feeds every request its last token; returns the next-token logits, [rows, vocab]."""
        device = self._model.device
        self._kv.reserve(0, 1)
        width = self._kv.width
        kv_lens = torch.tensor([request.kv_len for request in self.requests], device=device)
        attention_mask = (
            torch.arange(width + 1, device=device)[None, :] >= (width - kv_lens)[:, None]
        )
        # Past its images a token's position is the same on M-RoPE's three axes.
        deltas = torch.tensor([request.rope_delta for request in self.requests], device=device)
        output = self._model(
            input_ids=torch.tensor([[r.token_ids[-1]] for r in self.requests], device=device),
            attention_mask=attention_mask,
            position_ids=(kv_lens + deltas)[:, None],
            cache=self._kv.cache,
            use_cache=True,
        )
        for request in self.requests:
            request.kv_len += 1
        return output.logits[:, -1, :].float()


class ModelRunner:
    """The model, its running batch, and the forwards, samples and weight loads run on them."""

    def __init__(self, model: PreTrainedModel, max_batch_size: int, max_model_len: int):
        self.model = model
        self.eos_token_ids = eos_token_ids(model)
        self.image_token_id: int | None = getattr(model.config, "image_token_id", None)
        self.vocab_size = model.get_input_embeddings().num_embeddings
        self.batch = RunningBatch(model, max_batch_size, max_model_len)
        self.policy_version = 0
        # The parameters' home once a weight push has laid them out as it travels.
        self._weight_buffer: BucketedWeights | None = None
        # The base parameters by their checkpoint names, which LoRA layers change (q_proj.weight
        # becomes q_proj.base_layer.weight) but keep the same objects.
        self._parameters = dict(model.named_parameters(remove_duplicate=False))
        self.adapter: LoraAdapter | None = None  # the shape of the LoRA layers put on
        self.counters = {"tokens_generated": 0, "prefill_tokens": 0, "prefill_forwards": 0}

    def prefill(self, requests: list[Request]) -> list[Kv | None]:
        """Computes the KV of each request's tokens but the last, after the session KV it
        reuses, in one forward; returns each one's KV (None: no tokens before its last). The
        decode step feeds the last token and samples the first new one from its logits."""
        for request in requests:
            if request.images and request.vision is None:
                request.vision = RequestVision(self.model, request.token_ids, request.images)
        self._share_prompt_prefix(requests)
        kvs = [request.reused_kv for request in requests]
        for request in requests:
            computed = len(request.token_ids) - request.kv_len  # the last token's included
            request.computed_prompt_tokens += computed
            self.counters["prefill_tokens"] += computed
            request.reused_kv = None
        rows = [row for row, r in enumerate(requests) if r.kv_len < len(r.token_ids) - 1]
        if rows:
            computed_kvs = self._prefill_forward(
                [kvs[row] for row in rows],
                [requests[row].token_ids[requests[row].kv_len : -1] for row in rows],
                [requests[row].vision for row in rows],
            )
            for row, kv in zip(rows, computed_kvs, strict=True):
                kvs[row] = kv
        for request in requests:
            request.kv_len = len(request.token_ids) - 1
        return kvs

    def _prefill_forward(
        self,
        past_kvs: list[Kv | None],
        new_ids: list[list[int]],
        visions: list[RequestVision | None] | None = None,
    ) -> list[Kv]:
        """Runs `new_ids[i]` after the KV `past_kvs[i]` (None: none) for every row i in one
        forward; returns each row's KV, past and new, as views of one batch cache. A row with
        images (its `visions[i]`) runs on its input embeddings and 3-D positions
        (`hf_vision`), and then every row does.

        Row i holds its past left-padded to the longest past and its new tokens right-padded,
        so its KV is one run of columns; the right padding is invisible to it (causal)."""
        device = self.model.device
        past_lens = [kv[0][0].shape[-2] if kv else 0 for kv in past_kvs]
        new_lens = [len(ids) for ids in new_ids]
        past_width, new_width = max(past_lens), max(new_lens)
        cache = BatchKv(self.batch.kv_layout(), len(new_ids), past_width + new_width)
        cache.reserve(past_width, new_width)
        cache.append(past_kvs)
        past = torch.tensor(past_lens, device=device)[:, None]
        is_new = (
            torch.arange(new_width, device=device)[None, :]
            < torch.tensor(new_lens, device=device)[:, None]
        )
        is_past = torch.arange(past_width, device=device)[None, :] >= past_width - past
        # Padding gets position 0, a position every model has.
        position_ids = torch.where(is_new, past + torch.arange(new_width, device=device), 0)
        padded_ids = torch.tensor(
            [ids + [0] * (new_width - len(ids)) for ids in new_ids], device=device
        )
        if visions is not None and any(visions):
            inputs = prefill_inputs(self.model, padded_ids, past_lens, new_lens, visions)
        else:
            inputs = {"input_ids": padded_ids, "position_ids": position_ids}
        self.model(
            **inputs,
            attention_mask=torch.cat([is_past, is_new], dim=1),
            cache=cache.cache,
            use_cache=True,
            logits_to_keep=1,
        )
        self.counters["prefill_forwards"] += 1
        return [
            cache.row_kv(row, slice(past_width - past_len, past_width + new_len))
            for row, (past_len, new_len) in enumerate(zip(past_lens, new_lens, strict=True))
        ]

    def _share_prompt_prefix(self, requests: list[Request]) -> None:
        """Computes once what the prompts of the requests without reused KV share, and hands
        each its KV as if cached (a prefix's KV is the same whoever computes it, up to float
        rounding): first the prefix they all share (a system prompt) when it is at least
        MIN_SHARED_PREFIX_TOKENS long, in a forward of its own; then the prompt of each group
        of requests with the same prompt (a GRPO group's samples) but its last token, one row
        per group of a second forward."""
        fresh = [request for request in requests if request.kv_len == 0]
        if len(fresh) < 2:
            return
        shared = min(
            _common_prefix_len([request.token_ids for request in fresh]),
            *(len(request.token_ids) - 1 for request in fresh),
            # Image tokens are alike whatever the image: what they share ends at the first.
            *(request.images[0].token_offset for request in fresh if request.images),
        )
        if shared >= MIN_SHARED_PREFIX_TOKENS:
            (kv,) = self._prefill_forward([None], [fresh[0].token_ids[:shared]])
            self.counters["prefill_tokens"] += shared
            for request in fresh:
                request.reused_kv = kv
                request.kv_len = request.cached_prompt_tokens = shared
        same_prompt: dict[tuple, list[Request]] = {}
        for request in fresh:
            key = (tuple(request.token_ids), request.image_keys)
            same_prompt.setdefault(key, []).append(request)
        groups = [
            group
            for group in same_prompt.values()
            if len(group) > 1 and group[0].kv_len < len(group[0].token_ids) - 1
        ]
        if not groups:
            return
        kvs = self._prefill_forward(
            [group[0].reused_kv for group in groups],
            [group[0].token_ids[group[0].kv_len : -1] for group in groups],
            [group[0].vision for group in groups],
        )
        for group, kv in zip(groups, kvs, strict=True):
            self.counters["prefill_tokens"] += len(group[0].token_ids) - 1 - group[0].kv_len
            for request in group:
                request.reused_kv = kv
                request.kv_len = request.cached_prompt_tokens = len(request.token_ids) - 1

    def sample(self, requests: list[Request], logits: torch.Tensor) -> dict[int, Exception]:
        """Appends one token per request (row of `logits`) with its logprob under the raw
        distribution (see `HfEngine` for why). A row that cannot be sampled (the model's
        logits are NaN) gets no token: its error is returned by row, for that request alone
        to fail."""
        tokens, failed = next_tokens(logits, requests)
        rows = [row for row in range(len(requests)) if row not in failed]
        if not rows:
            return failed
        index = torch.tensor(rows, device=logits.device)
        picked = tokens[index]
        logprobs = logits[index].log_softmax(-1).gather(1, picked[:, None])[:, 0].tolist()
        for row, token, logprob in zip(rows, picked.tolist(), logprobs, strict=True):
            request = requests[row]
            request.token_ids.append(token)
            request.output_ids.append(token)
            request.logprobs.append(logprob)
            request.policy_versions.append(self.policy_version)
        self.counters["tokens_generated"] += len(rows)
        return failed

    def check_shapes(
        self, shapes: Iterable[tuple[str, tuple[int, ...]]]
    ) -> dict[str, torch.nn.Parameter]:
        """The model's parameters by name, once every (name, shape) is checked against them:
        InvalidArgumentError names the first unknown name or wrong shape."""
        parameters = self._parameters
        for name, shape in shapes:
            if name not in parameters:
                raise InvalidArgumentError(
                    f"unknown parameter {name!r}; the model has no such name"
                )
            if tuple(shape) != tuple(parameters[name].shape):
                raise InvalidArgumentError(
                    f"parameter {name!r} has shape {tuple(parameters[name].shape)}, "
                    f"got {tuple(shape)}"
                )
        return parameters

    def lay_out_parameters(
        self, metas: list[TensorMeta], bucket_size_bytes: int
    ) -> BucketedWeights | None:
        """Moves the parameters into one buffer laid out as `metas` travel (see
        `HfEngine.weight_buffer`); the same buffer again for the same layout."""
        current = self._weight_buffer
        if current is not None and current.matches(metas, bucket_size_bytes):
            return current
        parameters = self.check_shapes((meta.name, meta.shape) for meta in metas)
        targets = [parameters[meta.name] for meta in metas]
        if not targets or len({id(p) for p in targets}) < len(targets):
            return None
        if any(p.dtype != meta.dtype for p, meta in zip(targets, metas, strict=True)):
            return None
        layout = BucketedWeights(metas, bucket_size_bytes, device=targets[0].device)
        for index, parameter in enumerate(targets):
            place = layout.tensor(index)
            place.copy_(parameter)
            parameter.data = place
        self._weight_buffer = layout
        return layout

    def load_weights(
        self, named_tensors: list[tuple[str, torch.Tensor]], policy_version: int
    ) -> None:
        """Copies the tensors into the parameters of their names (all checked first) and takes
        `policy_version`. KV computed under the old weights is the caller's to drop."""
        parameters = self.check_shapes((name, tuple(t.shape)) for name, t in named_tensors)
        for name, tensor in named_tensors:
            if tensor.data_ptr() != parameters[name].data_ptr():  # else received in place
                parameters[name].copy_(tensor)
        # Whole weights are the whole policy: an adapter applied so far would count twice.
        for name, parameter in self.model.named_parameters():
            if ".lora_B." in name:
                parameter.zero_()
        self.policy_version = policy_version

    def load_adapter(
        self,
        adapter: LoraAdapter,
        named_tensors: list[tuple[str, torch.Tensor]],
        policy_version: int,
    ) -> None:
        """Copies a LoRA adapter, under peft's saved names, into the model's LoRA layers and
        takes `policy_version`. The first adapter puts the layers on (peft's
        `inject_adapter_in_model`: each target linear layer becomes a LoRA layer in place, so
        the forwards apply it); later ones must have its shape. FailedPreconditionError for
        another rank, alpha or target modules: the layers cannot be taken off again cleanly,
        and a run's LoRA settings are fixed, so only a new run with other settings meets it,
        and its rollout service restarts to load its model afresh. InvalidArgumentError, with
        the model unchanged, for a name the layers lack, a wrong shape, or a layer left out.
        KV computed under the old adapter is the caller's to drop."""
        if self.adapter is None:
            config = LoraConfig(
                r=adapter.rank,
                lora_alpha=adapter.alpha,
                target_modules=list(adapter.target_modules),
                lora_dropout=0.0,
            )
            inject_adapter_in_model(config, self.model)
            self.adapter = adapter
        elif adapter != self.adapter:
            raise FailedPreconditionError(
                f"the engine applies LoRA adapters of {self.adapter}, not {adapter}; restart "
                "the rollout service to load adapters of another shape"
            )
        slots = {
            name: parameter
            for name, parameter in self.model.named_parameters()
            if ".lora_A." in name or ".lora_B." in name
        }
        tensors = {adapter_parameter_name(name): tensor for name, tensor in named_tensors}
        for name, tensor in tensors.items():
            if name not in slots:
                raise InvalidArgumentError(f"{name!r} is no LoRA adapter tensor of the model")
            if tuple(tensor.shape) != tuple(slots[name].shape):
                raise InvalidArgumentError(
                    f"adapter tensor {name!r} has shape {tuple(tensor.shape)}, the model's "
                    f"{tuple(slots[name].shape)}"
                )
        missing = sorted(slots.keys() - tensors.keys())
        if missing:
            raise InvalidArgumentError(
                f"the adapter leaves out {len(missing)} of the model's adapter tensors, e.g. "
                f"{missing[0]!r}"
            )
        for name, tensor in tensors.items():
            slots[name].copy_(tensor)
        self.policy_version = policy_version


def adapter_parameter_name(saved_name: str) -> str:
    """The model's parameter that holds a peft saved adapter tensor:
    "base_model.model.X.lora_A.weight" is "X.lora_A.default.weight" once peft put its layers
    on the model (under the adapter name "default")."""
    name = saved_name.removeprefix(PEFT_PREFIX)
    for part in ("lora_A", "lora_B"):
        name = name.replace(f".{part}.weight", f".{part}.default.weight")
    return name


def _common_prefix_len(sequences: list[list[int]]) -> int:
    """Length of the longest prefix of all the sequences: that of the least and the greatest."""
    first, last = min(sequences), max(sequences)
    return next(
        (i for i, (a, b) in enumerate(zip(first, last, strict=False)) if a != b), len(first)
    )
