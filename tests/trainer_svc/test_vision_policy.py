"""The trainer on a vision-language policy (issue 35; a tiny random Qwen2.5-VL with
Qwen2.5-VL's real image processor config): rows with images get the logprobs of a forward with
their pixel values, a train step reaches the vision tower, and a trajectory's images are
processed again from its messages' bytes and checked against its records."""

from pathlib import Path

import pytest
import torch

from tests.tiny_vlm import (
    IMAGE_TOKEN,
    VISION_END,
    VISION_START,
    forward_logprobs,
    png_bytes,
    save_tiny_vlm,
)
from tests.trainer_svc.fsdp_worker import token_mean_loss
from trainer_svc.batch import Batch
from trainer_svc.config import TrainSettings
from trainer_svc.fsdp import FsdpPolicy
from trainer_svc.rl_step import rollout_batch
from turnrl.images import ImageSettings, load_image
from turnrl.trajectory import FinishReason, Segment, SegmentSource, Trajectory, TrajectoryImage
from turnrl.v1 import common_pb2
from turnrl.vision import VisionProcessor

# Long enough micro-batches that both rows go in one: their images in one forward.
SETTINGS = TrainSettings(learning_rate=1e-3, micro_batch_tokens=4096)


@pytest.fixture(scope="module")
def vlm_dir(tmp_path_factory: pytest.TempPathFactory, fixtures: Path) -> Path:
    return save_tiny_vlm(tmp_path_factory.mktemp("tiny-qwen2.5-vl"), fixtures)


def image_trajectory(vision: VisionProcessor, seed: int, index: int) -> Trajectory:
    """A prompt with one image of random pixels and a model turn of five tokens."""
    image = load_image(
        common_pb2.Image(data=png_bytes(60 + 30 * seed, 60, seed), mime_type="image/png"),
        ImageSettings(),
        "x",
    )
    processed = vision.process(image)
    prompt = [5, 6, VISION_START, *[IMAGE_TOKEN] * processed.token_count, VISION_END, 7]
    return Trajectory(
        trajectory_id=f"g/{index}",
        group_id="g",
        sample_index=index,
        segments=[
            Segment(SegmentSource.PROMPT, prompt),
            Segment(SegmentSource.MODEL, [20 + seed, 21, 22, 23, 24], [-1.0] * 5),
        ],
        messages=[
            {
                "role": "user",
                "content": [{"type": "image_url", "image_url": {"url": image.data_url()}}],
            },
            {"role": "assistant", "content": "x"},
        ],
        finish_reason=FinishReason.STOP,
        reward=common_pb2.Reward(score=float(seed)),
        images=[TrajectoryImage(3, processed.token_count, image.sha256, processed.grid_thw)],
    )


def test_rows_with_images_train_on_the_logprobs_of_a_forward_with_their_pixels(vlm_dir):
    vision = VisionProcessor(vlm_dir)
    trajectories = [image_trajectory(vision, seed, seed) for seed in (1, 2)]
    batch = rollout_batch(trajectories, pad_token_id=0, vision=vision).batch
    assert [len(row) for row in batch.images] == [1, 1]
    policy = FsdpPolicy(vlm_dir, SETTINGS)
    logprobs, _ = policy.logprobs(batch)
    for row, trajectory in enumerate(trajectories):
        expected = forward_logprobs(policy.model, trajectory.token_ids, batch.images[row])
        length = len(trajectory.token_ids)
        torch.testing.assert_close(logprobs[row, 1:length], expected, atol=1e-5, rtol=0)

    visual_before = {
        name: parameter.detach().clone()
        for name, parameter in policy.model.named_parameters()
        if ".visual." in f".{name}"
    }
    advantages = torch.where(batch.loss_mask, 1.0, 0.0)
    trained = Batch(**{**vars(batch), "extras": {**batch.extras, "advantages": advantages}})
    metrics = policy.train_step(trained, token_mean_loss)
    assert torch.isfinite(torch.tensor(metrics["loss"]))
    moved = [
        name
        for name, parameter in policy.model.named_parameters()
        if name in visual_before and not torch.equal(parameter, visual_before[name])
    ]
    assert moved  # the loss reached the vision tower through the image tokens' features


def test_an_image_the_trainer_processes_otherwise_than_the_rollout_is_refused(vlm_dir):
    vision = VisionProcessor(vlm_dir)
    trajectory = image_trajectory(vision, 1, 0)
    record = trajectory.images[0]
    trajectory.images = [TrajectoryImage(3, record.token_count, record.sha256, (1, 99, 4))]
    with pytest.raises(ValueError, match=r"image 0 .* processed to a \(1, \d+, \d+\) grid, but"):
        rollout_batch([trajectory], pad_token_id=0, vision=vision)
    with pytest.raises(ValueError, match="has images, but the policy is a text-only model"):
        rollout_batch([image_trajectory(vision, 1, 0)], pad_token_id=0)
