"""FsdpPolicy with `trainer.lora` on a tiny random Qwen3: only the adapters train, the base is
the reference, the merged weights and the exported adapters are the policy, checkpoints hold
the adapters, 2-rank FSDP2 equals one process; and LoRA runs through the trainer service,
sync and async."""

import json
from pathlib import Path

import pytest
import torch
from peft import PeftModel, get_peft_model
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from tests.trainer_svc.fsdp_worker import (
    SETTINGS,
    checkpoint_tensors,
    fixed_batch,
    token_mean_loss,
    write_checkpoint,
)
from tests.trainer_svc.runs import State, follow, run_config
from tests.trainer_svc.test_weight_push import connected, load, packed
from tests.trainer_svc.two_ranks import run_on_two_ranks
from trainer_svc.batch import Batch
from trainer_svc.checkpoint import model_checkpoint_state
from trainer_svc.config import LoraSettings
from trainer_svc.forward import whole_row_logprobs
from trainer_svc.fsdp import FsdpPolicy
from trainer_svc.lora import add_lora_adapters, lora_config
from trainer_svc.ranks import Models, restore
from trainer_svc.run_loop import FINAL_MODEL
from turnrl import rpc
from turnrl.config import ClientConfig
from turnrl.v1 import rollout_pb2, rollout_pb2_grpc, trainer_pb2, trainer_pb2_grpc

LORA = LoraSettings(rank=4, alpha=8.0)
WORKER = Path(__file__).with_name("lora_worker.py")
WORKER_TIMEOUT_SECONDS = 120


def lora_policy(model_dir: Path, lora: LoraSettings = LORA) -> FsdpPolicy:
    return FsdpPolicy(model_dir, SETTINGS, lora)


def trained_policy(model_dir: Path, steps: int = 2) -> FsdpPolicy:
    policy = lora_policy(model_dir)
    for _ in range(steps):
        policy.train_step(fixed_batch(), token_mean_loss)
    return policy


def model_logprobs(model: torch.nn.Module, batch: Batch) -> torch.Tensor:
    with torch.no_grad():
        logprobs, _ = whole_row_logprobs(model, batch.input_ids, batch.attention_mask, False)
    return logprobs


def parameters(policy: FsdpPolicy) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in policy.model.named_parameters()}


def test_only_the_adapters_train(model_dir):
    policy = lora_policy(model_dir)
    before = parameters(policy)
    trained = trained_policy(model_dir)
    after = parameters(trained)
    adapters = {name for name in after if ".lora_" in name}
    assert policy.adapter_target_modules == ["k_proj", "o_proj", "q_proj", "v_proj"]
    assert len(adapters) == 2 * 4 * 2  # A and B of 4 layers in each of 2 decoder layers
    for name in after:
        changed = not torch.equal(before[name], after[name])
        assert changed == (name in adapters), name
    optimized = {p for group in trained.optimizer.param_groups for p in group["params"]}
    named = dict(trained.model.named_parameters())
    assert optimized == {named[name] for name in adapters}
    assert set(trained.optimizer.state) == optimized


def test_the_reference_is_the_base_model(model_dir):
    batch = fixed_batch()
    base_logprobs, _ = FsdpPolicy(model_dir, SETTINGS).logprobs(batch)
    policy = trained_policy(model_dir)
    torch.testing.assert_close(policy.reference_logprobs(batch), base_logprobs, atol=0, rtol=0)
    trained_logprobs, _ = policy.logprobs(batch)
    assert float((trained_logprobs - base_logprobs).abs().max()) > 1e-4


def test_merged_weights_are_the_policy_under_the_base_names(model_dir):
    batch = fixed_batch()
    policy = trained_policy(model_dir)
    merged = policy.full_state_dict()
    plain = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    assert merged.keys() == plain.state_dict().keys()
    plain.load_state_dict(merged)
    expected, _ = policy.logprobs(batch)
    torch.testing.assert_close(model_logprobs(plain, batch), expected, atol=1e-5, rtol=0)
    pushed = dict(policy.full_weights(bucket_size_bytes=8192).named_tensors())
    assert set(merged) - set(pushed) == {"lm_head.weight"}  # tied to the embedding: sent once
    assert all(torch.equal(pushed[name], merged[name]) for name in pushed)


def test_adapters_have_the_names_and_files_peft_writes(model_dir, tmp_path):
    batch = fixed_batch()
    policy = trained_policy(model_dir)
    peft_model = get_peft_model(
        AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32),
        lora_config(LORA, policy.adapter_target_modules),
    )
    peft_model.save_pretrained(tmp_path / "peft")
    peft_file = load_file(tmp_path / "peft" / "adapter_model.safetensors")
    adapters = policy.adapter_state_dict()
    assert adapters.keys() == peft_file.keys()
    assert all(adapters[name].shape == peft_file[name].shape for name in adapters)

    (tmp_path / "tokenizer").mkdir()
    (tmp_path / "tokenizer" / "tokenizer.json").write_text("{}")
    policy.save_pretrained(tmp_path / "adapter", tokenizer_dir=tmp_path / "tokenizer")
    assert (tmp_path / "adapter" / "tokenizer.json").read_text() == "{}"
    expected, _ = policy.logprobs(batch)
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    loaded = PeftModel.from_pretrained(base, tmp_path / "adapter")
    torch.testing.assert_close(model_logprobs(loaded, batch), expected, atol=1e-5, rtol=0)
    # transformers loads the adapter folder on the base model it names.
    auto = AutoModelForCausalLM.from_pretrained(tmp_path / "adapter", dtype=torch.float32)
    torch.testing.assert_close(model_logprobs(auto, batch), expected, atol=1e-5, rtol=0)

    policy.save_merged(tmp_path / "merged", tokenizer_dir=tmp_path / "tokenizer")
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32)
    torch.testing.assert_close(model_logprobs(merged, batch), expected, atol=1e-5, rtol=0)


def test_a_checkpoint_holds_the_adapters_and_resumes_identically(model_dir, tmp_path):
    batch = fixed_batch()
    trained = trained_policy(model_dir, steps=1)
    checkpoint = write_checkpoint(Models(trained), tmp_path, 1)
    names = checkpoint_tensors(checkpoint)
    assert names and all(".lora_" in name for name in names)
    expected_metrics = trained.train_step(batch, token_mean_loss)

    resumed = lora_policy(model_dir)
    restore(Models(resumed), checkpoint)
    assert resumed.train_step(batch, token_mean_loss) == pytest.approx(expected_metrics, abs=0)
    assert all(
        torch.equal(resumed.full_state_dict()[name], tensor)
        for name, tensor in trained.full_state_dict().items()
    )


def test_every_rank_builds_the_same_adapters_whatever_the_rng(model_dir):
    gaussian = LORA.model_copy(update={"init": "gaussian"})  # A random, B zero
    torch.manual_seed(1)
    first = lora_policy(model_dir, gaussian).adapter_state_dict()
    torch.manual_seed(2)
    second = lora_policy(model_dir, gaussian).adapter_state_dict()
    assert all(torch.equal(first[name], second[name]) for name in first)
    # Drawn as peft draws them: A normal with std 1 / rank, B zero.
    down = torch.cat([t.flatten() for name, t in first.items() if ".lora_A." in name])
    assert abs(float(down.std()) - 1 / gaussian.rank) < 0.02
    assert all(not t.any() for name, t in first.items() if ".lora_B." in name)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    rng_state = torch.get_rng_state()
    add_lora_adapters(model, gaussian)
    assert torch.equal(torch.get_rng_state(), rng_state)  # the caller's RNG left alone


def test_all_linear_targets_every_linear_layer_but_the_head(model_dir):
    policy = lora_policy(model_dir, LORA.model_copy(update={"target_modules": ["all-linear"]}))
    assert policy.adapter_target_modules == [
        "down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj",
    ]  # fmt: skip


@pytest.mark.parametrize(
    ("update", "message"),
    [
        ({"target_modules": ["qkv"]}, r"trainer.lora.target_modules=\['qkv'\] .* \['down_proj'"),
        ({"target_modules": ["embed_tokens"]}, "trainer.lora.target_modules"),
        ({"rank": 33}, r"trainer.lora.rank=33 .* \(32\) .* model.layers.0.self_attn.k_proj"),
    ],
)
def test_targets_and_rank_are_checked_against_the_model(model_dir, update, message):
    with pytest.raises(ValueError, match=message):
        lora_policy(model_dir, LORA.model_copy(update=update))


def test_two_rank_fsdp_equals_one_process(model_dir, tmp_path):
    batch = fixed_batch()
    single = lora_policy(model_dir)
    single_logprobs, _ = single.logprobs(batch)
    single_metrics = single.train_step(batch, token_mean_loss)
    single_adapters = single.adapter_state_dict()
    single_merged = single.full_state_dict()

    run_on_two_ranks(WORKER, model_dir, tmp_path, timeout_seconds=WORKER_TIMEOUT_SECONDS)
    ranks = torch.load(tmp_path / "rank0.pt", weights_only=True)

    torch.testing.assert_close(ranks["logprobs"], single_logprobs, atol=1e-6, rtol=0)
    torch.testing.assert_close(
        ranks["reference"], single.reference_logprobs(batch), atol=1e-6, rtol=0
    )
    assert ranks["metrics"] == pytest.approx(single_metrics, abs=1e-5)
    assert ranks["adapters"].keys() == single_adapters.keys()
    for name, tensor in single_adapters.items():
        torch.testing.assert_close(ranks["adapters"][name], tensor, atol=2e-5, rtol=0)
    assert ranks["merged"].keys() == single_merged.keys()
    for name, tensor in single_merged.items():
        torch.testing.assert_close(ranks["merged"][name], tensor, atol=2e-5, rtol=0)
    assert ranks["checkpoint"].keys() == model_checkpoint_state(single)[0]["model"].keys()
    assert ranks["other_rank_adapters"] == 0


@pytest.mark.parametrize(
    ("loop", "algorithm"),
    [
        ("sync", {"advantage_estimator": "grpo", "kl_coef": 0.01, "mini_batches": 2}),
        ("async", {"advantage_estimator": "gae", "gae_lambda": 0.95}),
    ],
)
async def test_a_lora_run_pushes_its_adapters_exports_them_and_resumes(
    services, tmp_path, loop, algorithm, tiny_model_dir
):
    name = f"lora-{loop}"
    lora = {"rank": 4, "alpha": 8.0, "export_merged": True}
    # The engine serves another run's fully fine-tuned weights: the adapters must not apply
    # to those.
    await push_weights_of_another_run(services["rollout"], tiny_model_dir)
    trained = []
    for steps in (2, 3):  # two steps, then one more after a resume
        config = run_config(
            services, tmp_path, run_name=name, steps=steps, eval_every=0, loop=loop,
            algorithm=algorithm, lora=lora,
        )  # fmt: skip
        async with rpc.open_channel(ClientConfig(address=services["trainer"])) as channel:
            stub = trainer_pb2_grpc.TrainerServiceStub(channel)
            request = trainer_pb2.StartRunRequest(config_yaml=config, resume=steps == 3)
            await stub.StartRun(request, timeout=60)
            events = await follow(stub, name)
            run = (await stub.GetRun(trainer_pb2.GetRunRequest(run_name=name), timeout=10)).run
        assert run.state == State.STATE_SUCCEEDED and run.step == steps, run.error_message
        trained += [event for event in events if event.stage == "train"]
    assert [event.step for event in trained] == [1, 2, 3]  # the resumed run's one step last
    # The engine samples from the trainer's base weights and the adapters it pushed (the async
    # loop's step 2 trains on step 1's samples too: their policy is one push old).
    on_policy = [e.metrics["mismatch/staleness_0/mean_abs_diff"] for e in trained if e.step != 2]
    assert max(on_policy) < 1e-5

    run_dir = Path(run.output_dir)
    adapters = checkpoint_tensors(run_dir / "checkpoints" / "step_000003")
    assert adapters and all(".lora_" in name for name in adapters)
    summary = json.loads((run_dir / "summary.json").read_text())
    adapter_sizes = [tensor.numel() for tensor in adapters.values()]
    assert summary["trainable_parameters"] == sum(adapter_sizes)
    final_model = run_dir / FINAL_MODEL
    assert (final_model / "adapter_config.json").is_file()
    adapted = AutoModelForCausalLM.from_pretrained(final_model, dtype=torch.float32)
    merged = AutoModelForCausalLM.from_pretrained(final_model / "merged", dtype=torch.float32)
    batch = fixed_batch()
    torch.testing.assert_close(
        model_logprobs(adapted, batch), model_logprobs(merged, batch), atol=1e-5, rtol=0
    )


async def push_weights_of_another_run(rollout_address: str, model_dir: Path) -> None:
    """Pushes the weights of `model_dir` moved by noise to the rollout service, as the full
    fine-tuning of another run would have left them."""
    perturbed = load(model_dir, noise_seed=11).state_dict()
    async with rpc.open_channel(ClientConfig(address=rollout_address)) as channel:
        stub = rollout_pb2_grpc.RolloutServiceStub(channel)
        stats = await stub.GetStats(rollout_pb2.GetStatsRequest(), timeout=10)
        async with connected([stub], "grpc") as pusher:
            await pusher.push(packed(perturbed), stats.policy_version + 1)
