"""FsdpPolicy on a tiny random Qwen3: logprobs, micro-batching, 2-rank FSDP2, checkpoints, export."""

import math
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from tests.trainer_svc.fsdp_worker import (
    SETTINGS,
    STEPS,
    fixed_batch,
    grouped_batch,
    step_gradients,
    token_mean_loss,
    write_checkpoint,
)
from tests.trainer_svc.two_ranks import run_on_two_ranks
from trainer_svc.batch import Batch, micro_batch_rows
from trainer_svc.config import TrainSettings
from trainer_svc.fsdp import FsdpPolicy, lr_factor
from trainer_svc.ranks import Models, restore

WORKER = Path(__file__).with_name("fsdp_worker.py")
WORKER_TIMEOUT_SECONDS = 120


def policy(model_dir: Path, **settings) -> FsdpPolicy:
    return FsdpPolicy(model_dir, SETTINGS.model_copy(update=settings))


def max_difference(left: dict[str, torch.Tensor], right: dict[str, torch.Tensor]) -> float:
    assert left.keys() == right.keys()
    return max(float((left[name] - right[name]).abs().max()) for name in left)


def test_from_sequences_rejects_rows_of_other_lengths():
    with pytest.raises(ValueError, match=r"loss_masks row lengths \[2\] differ .* \[3\]"):
        Batch.from_sequences([[1, 2, 3]], [[True, True]])


def test_micro_batch_rows_fill_the_token_budget_longest_first():
    assert micro_batch_rows([3, 10, 4, 5, 2], max_tokens=12) == [[1], [3, 2], [0, 4]]


def test_lr_warms_up_then_follows_a_cosine_to_the_minimum():
    settings = TrainSettings(warmup_steps=2, lr_schedule="cosine", total_steps=6, min_lr_ratio=0.1)
    factors = [lr_factor(step, settings) for step in range(8)]
    assert factors[:3] == [0.5, 1.0, 1.0]
    assert factors[4] == pytest.approx(0.55)
    assert factors[6:] == [pytest.approx(0.1)] * 2
    with pytest.raises(ValueError, match="total_steps=2"):
        TrainSettings(lr_schedule="cosine", warmup_steps=2, total_steps=2)
    # 0 is left for the trainer service to fill in; a schedule cannot run on it.
    with pytest.raises(ValueError, match="needs total_steps"):
        lr_factor(3, TrainSettings(lr_schedule="cosine"))


def test_a_cosine_without_total_steps_decays_over_the_run():
    assert TrainSettings(lr_schedule="cosine").for_run(30).total_steps == 30
    assert TrainSettings(lr_schedule="cosine", total_steps=9).for_run(30).total_steps == 9
    assert TrainSettings(lr_schedule="constant").for_run(30).total_steps == 0
    with pytest.raises(ValueError, match="total_steps > warmup_steps"):
        TrainSettings(lr_schedule="cosine", warmup_steps=5).for_run(3)


def test_logprobs_match_a_full_forward_whatever_the_micro_batches_and_row_order(model_dir):
    batch = fixed_batch()
    lengths = batch.attention_mask.sum(1).tolist()
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    expected = torch.zeros(batch.input_ids.shape)
    expected_entropy = torch.zeros(batch.input_ids.shape)
    with torch.no_grad():
        for row, length in enumerate(lengths):
            ids = batch.input_ids[row : row + 1, :length]
            log_probs = model(ids).logits[0, :-1].log_softmax(-1)
            expected[row, 1:length] = log_probs.gather(-1, ids[0, 1:, None])[:, 0]
            expected_entropy[row, 1:length] = -(log_probs.exp() * log_probs).sum(-1)

    one_micro_batch = policy(model_dir, micro_batch_tokens=4096)
    logprobs, entropy = one_micro_batch.logprobs(batch, with_entropy=True)
    torch.testing.assert_close(logprobs, expected, atol=1e-5, rtol=0)
    torch.testing.assert_close(entropy, expected_entropy, atol=1e-5, rtol=0)
    tiny_micro_batches = policy(model_dir, micro_batch_tokens=1)
    torch.testing.assert_close(tiny_micro_batches.logprobs(batch)[0], expected, atol=1e-5, rtol=0)
    reversed_rows = list(reversed(range(len(lengths))))
    logprobs_reversed, _ = one_micro_batch.logprobs(
        batch.select(reversed_rows, torch.device("cpu"))
    )
    torch.testing.assert_close(logprobs_reversed, expected[reversed_rows], atol=1e-5, rtol=0)


def test_micro_batched_step_equals_one_big_batch_step(model_dir):
    # Gradients are compared, not updated weights: Adam's first update is about lr * sign(grad),
    # so float noise flips it where a gradient is near zero, and it hides any loss scale.
    batch = fixed_batch()
    assert len(micro_batch_rows(batch.attention_mask.sum(1).tolist(), 24)) > 3
    big, small = policy(model_dir, micro_batch_tokens=4096), policy(model_dir)
    big_gradients, small_gradients = step_gradients(big), step_gradients(small)
    big_metrics = big.train_step(batch, token_mean_loss)
    small_metrics = small.train_step(batch, token_mean_loss)
    assert max_difference(big_gradients, small_gradients) <= 1e-7
    assert max(float(gradient.abs().max()) for gradient in big_gradients.values()) > 1e-2
    assert small_metrics == pytest.approx(big_metrics, abs=1e-6)
    assert big_metrics["grad_norm"] > SETTINGS.grad_clip  # clipping was part of the step


def test_two_rank_fsdp_equals_one_process(model_dir, tmp_path):
    batch = fixed_batch()
    single = policy(model_dir)
    single_logprobs, _ = single.logprobs(batch)
    single_gradients = step_gradients(single)
    single_metrics = [single.train_step(batch, token_mean_loss) for _ in range(STEPS - 1)]
    step2 = write_checkpoint(Models(single), tmp_path / "single", STEPS - 1)
    single_metrics.append(single.train_step(batch, token_mean_loss))
    single_trained = single.full_state_dict()
    single_next = single.train_step(batch, token_mean_loss)
    grouped = policy(model_dir)
    grouped_logprobs, _ = grouped.logprobs(grouped_batch())
    grouped_gradients = step_gradients(grouped)
    grouped_metrics = grouped.train_step(grouped_batch(), token_mean_loss)

    run_on_two_ranks(WORKER, model_dir, step2, tmp_path, timeout_seconds=WORKER_TIMEOUT_SECONDS)
    ranks = torch.load(tmp_path / "rank0.pt", weights_only=False)

    torch.testing.assert_close(ranks["logprobs"], single_logprobs, atol=1e-6, rtol=0)
    assert max_difference(ranks["gradients"], single_gradients) <= 1e-7
    # Adam's first update is about lr * sign(grad), so where a gradient is near zero float noise
    # moves a weight by up to a few % of lr (1e-3); a step from equal Adam state stays at 1e-6.
    assert max_difference(ranks["trained"], single_trained) <= 2e-5
    assert max_difference(ranks["resumed"], single_trained) <= 1e-6
    pushed = ranks["pushed"]  # what rank 0 pushes: the gathered weights, the tied ones once
    assert max_difference(pushed, {name: ranks["trained"][name] for name in pushed}) == 0
    for two_rank, one_rank in zip([*ranks["metrics"], ranks["resumed_metrics"]],
                                  [*single_metrics, single_metrics[-1]], strict=True):  # fmt: skip
        assert two_rank == pytest.approx(one_rank, abs=1e-5)
    assert all(math.isfinite(value) for value in ranks["bf16_metrics"].values())
    # Each rank's share of a group computes the group's prefix once, in two forwards per
    # micro-batch (FSDP gathers the parameters for each).
    torch.testing.assert_close(ranks["grouped_logprobs"], grouped_logprobs, atol=1e-6, rtol=0)
    assert max_difference(ranks["grouped_gradients"], grouped_gradients) <= 1e-7
    assert ranks["grouped_metrics"] == pytest.approx(grouped_metrics, abs=1e-5)
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32)
    assert max_difference(exported.state_dict(), ranks["trained"]) == 0
    # The two ranks' checkpoint, each rank's shards, loads in one process: the same weights,
    # and Adam's state with them (the next step as the one process's own, within float noise).
    resumed = policy(model_dir)
    restore(Models(resumed), tmp_path / "run" / "checkpoints" / f"step_{STEPS:06d}")
    assert max_difference(resumed.full_state_dict(), ranks["trained"]) == 0
    assert resumed.train_step(batch, token_mean_loss) == pytest.approx(single_next, abs=1e-5)
    # The checkpoint the two ranks wrote in the background while they trained on holds the
    # weights of its step.
    background = policy(model_dir)
    restore(Models(background), tmp_path / "background" / "checkpoints" / f"step_{STEPS + 1:06d}")
    assert max_difference(background.full_state_dict(), ranks["resumed"]) == 0


def test_full_weights_are_the_live_weights_laid_out_for_a_push(model_dir):
    trained = policy(model_dir)  # tied embeddings
    weights = last = None
    for _ in range(2):
        trained.train_step(fixed_batch(), token_mean_loss)
        state = trained.full_state_dict()
        last, weights = weights, trained.full_weights(bucket_size_bytes=8192, reuse=weights)
        assert len(weights.buckets) > 1
        pushed = dict(weights.named_tensors())
        assert set(state) - set(pushed) == {"lm_head.weight"}  # it is the embedding: sent once
        assert max_difference(pushed, {name: state[name] for name in pushed}) == 0
    assert weights.data.data_ptr() == last.data.data_ptr()  # the last push's memory, reused


def test_checkpoint_resumes_identically_and_export_loads_with_transformers(model_dir, tmp_path):
    settings = {"warmup_steps": 1, "lr_schedule": "cosine", "total_steps": 4}
    batch = fixed_batch()
    trained = policy(model_dir, **settings)
    trained.train_step(batch, token_mean_loss)
    checkpoint = write_checkpoint(Models(trained), tmp_path / "run", 1)
    expected_metrics = trained.train_step(batch, token_mean_loss)

    resumed = policy(model_dir, **settings)
    restore(Models(resumed), checkpoint)
    assert resumed.train_step(batch, token_mean_loss) == pytest.approx(expected_metrics, abs=0)
    assert max_difference(resumed.full_state_dict(), trained.full_state_dict()) == 0

    (tmp_path / "tokenizer").mkdir()
    (tmp_path / "tokenizer" / "tokenizer.json").write_text("{}")
    trained.save_pretrained(tmp_path / "hf", tokenizer_dir=tmp_path / "tokenizer")
    assert (tmp_path / "hf" / "tokenizer.json").read_text() == "{}"
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32)
    assert trained.full_state_dict().keys() == exported.state_dict().keys()
    with torch.no_grad():
        torch.testing.assert_close(
            exported(batch.input_ids).logits, trained.model(batch.input_ids).logits, atol=0, rtol=0
        )


def test_bf16_step_gives_finite_metrics(model_dir):
    metrics = policy(model_dir, dtype="bfloat16").train_step(fixed_batch(), token_mean_loss)
    assert metrics.keys() == {"loss", "grad_norm", "lr", "mean_logprob"}
    assert all(math.isfinite(value) for value in metrics.values())


def test_activation_checkpointing_changes_no_weight(model_dir):
    plain, checkpointed = policy(model_dir), policy(model_dir, activation_checkpointing=True)
    assert checkpointed.model.is_activation_checkpointing
    for _ in range(2):
        plain.train_step(fixed_batch(), token_mean_loss)
        checkpointed.train_step(fixed_batch(), token_mean_loss)
    assert max_difference(plain.full_state_dict(), checkpointed.full_state_dict()) <= 1e-6
