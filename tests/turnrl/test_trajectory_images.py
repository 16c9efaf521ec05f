"""Image records on the trajectory: where each image's tokens sit, which image, its grid; they
cross the wire, and a record that does not fit its trajectory is refused."""

import pytest

from turnrl.errors import InvalidArgumentError
from turnrl.trajectory import FinishReason, Segment, SegmentSource, Trajectory, TrajectoryImage

IMAGE = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}


def with_two_images() -> Trajectory:
    """An image in the prompt (tokens 1-3), a model turn, an image in a tool result (9-10)."""
    return Trajectory(
        trajectory_id="g/0",
        group_id="g",
        sample_index=0,
        segments=[
            Segment(SegmentSource.PROMPT, [1, 9, 9, 9, 2]),
            Segment(SegmentSource.MODEL, [4, 5], [-0.5, -0.25]),
            Segment(SegmentSource.TOOL, [7, 8, 9, 9, 3]),
            Segment(SegmentSource.MODEL, [10], [-1.0]),
        ],
        messages=[
            {"role": "user", "content": [IMAGE, {"type": "text", "text": "Which?"}]},
            {"role": "assistant", "content": "zoom"},
            {"role": "tool", "content": [{"type": "text", "text": "Zoomed:"}, IMAGE]},
            {"role": "assistant", "content": "#### 3"},
        ],
        finish_reason=FinishReason.STOP,
        images=[
            TrajectoryImage(1, 3, "a" * 64, (1, 6, 2)),
            TrajectoryImage(9, 2, "b" * 64, (1, 4, 2)),
        ],
    )


def test_image_records_cross_the_wire():
    trajectory = with_two_images()
    received = Trajectory.from_proto(trajectory.to_proto())
    assert received.images == trajectory.images
    assert received.messages == trajectory.messages


@pytest.mark.parametrize(
    ("images", "error"),
    [
        ([TrajectoryImage(1, 3, "a", (1, 6, 2))], "1 image records for 2 images"),
        (
            [TrajectoryImage(1, 3, "a", (1, 6, 2)), TrajectoryImage(5, 2, "b", (1, 4, 2))],
            r"image 1's tokens \[5, 7\) overlap tokens the model sampled",
        ),
        (
            [TrajectoryImage(1, 3, "a", (1, 6, 2)), TrajectoryImage(2, 2, "b", (1, 4, 2))],
            r"image 1's tokens \[2, 4\) are not after the image before it \(at 4\)",
        ),
        (
            [TrajectoryImage(1, 3, "a", (1, 6, 2)), TrajectoryImage(12, 2, "b", (1, 4, 2))],
            r"image 1.s tokens \[12, 14\) .* within the 13 tokens",
        ),
    ],
)
def test_a_record_that_does_not_fit_its_trajectory_is_refused(images, error):
    trajectory = with_two_images()
    trajectory.images = images
    with pytest.raises(InvalidArgumentError, match=f"trajectory 'g/0': {error}"):
        Trajectory.from_proto(trajectory.to_proto())


def test_a_grid_of_other_than_three_sizes_is_refused():
    proto = with_two_images().to_proto()
    del proto.images[0].grid_thw[2]
    with pytest.raises(InvalidArgumentError, match=r"grid_thw has 3 sizes, got \[1, 6\]"):
        Trajectory.from_proto(proto)
