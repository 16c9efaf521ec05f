"""GRPO through the trainer's own pieces (rollout_batch, prepare_update, make_loss_fn,
FsdpPolicy.train_step) raises the reward of a small task: a random Qwen3 learns to write one
token. Rollouts are sampled from the policy's own model, as the engine would."""

import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from trainer_svc.config import AlgorithmConfig, TrainSettings
from trainer_svc.fsdp import FsdpPolicy
from trainer_svc.rl_step import make_loss_fn, prepare_update, rollout_batch
from turnrl.trajectory import Segment, SegmentSource, Trajectory
from turnrl.v1 import common_pb2

PROMPT = [1, 2, 3]
TARGET_TOKEN = 7
VOCAB = 16
NEW_TOKENS = 6
GROUPS, GROUP_SIZE = 4, 8


def sample_trajectories(model, generator: torch.Generator) -> list[Trajectory]:
    """GROUPS x GROUP_SIZE samples; reward = share of generated tokens equal to TARGET_TOKEN."""
    rows = GROUPS * GROUP_SIZE
    ids = torch.tensor([PROMPT] * rows)
    logprobs = torch.zeros(rows, NEW_TOKENS)
    with torch.no_grad():
        for step in range(NEW_TOKENS):
            distribution = torch.log_softmax(model(ids).logits[:, -1].float(), dim=-1)
            tokens = torch.multinomial(distribution.exp(), 1, generator=generator)
            logprobs[:, step] = distribution.gather(1, tokens)[:, 0]
            ids = torch.cat([ids, tokens], dim=1)
    trajectories = []
    for row in range(rows):
        generated = ids[row, len(PROMPT) :].tolist()
        segments = [
            Segment(SegmentSource.PROMPT, PROMPT),
            Segment(SegmentSource.MODEL, generated, logprobs[row].tolist()),
        ]
        reward = common_pb2.Reward(score=generated.count(TARGET_TOKEN) / NEW_TOKENS)
        trajectories.append(
            Trajectory(f"t{row}", f"g{row // GROUP_SIZE}", row, segments, reward=reward)
        )
    return trajectories


def test_grpo_raises_the_reward_of_a_small_task(tmp_path):
    config = Qwen3Config(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, head_dim=16, intermediate_size=64, tie_word_embeddings=True,
    )  # fmt: skip
    torch.manual_seed(0)
    Qwen3ForCausalLM(config).save_pretrained(tmp_path)
    policy = FsdpPolicy(tmp_path, TrainSettings(learning_rate=3e-2))
    algorithm = AlgorithmConfig(advantage_estimator="grpo")
    generator = torch.Generator().manual_seed(0)
    rewards = []
    for _ in range(15):
        rollouts = rollout_batch(sample_trajectories(policy.model, generator), pad_token_id=0)
        rewards.append(float(rollouts.rewards.mean()))
        mismatch = prepare_update(rollouts, policy, None, None, algorithm)
        # The sampler is the policy itself, so its logprobs are the trainer's.
        assert mismatch["mismatch/mean_abs_diff"] < 1e-4
        policy.train_step(rollouts.batch, make_loss_fn(algorithm, normalizer=NEW_TOKENS))
    assert rewards[0] < 0.25, rewards
    assert sum(rewards[-3:]) / 3 > 0.6, rewards
