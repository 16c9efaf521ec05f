"""Weight updates: bucket layout, a real gloo broadcast from a trainer-side rank 0 in another
process (`weight_sender`), in either layout, and the chunked fallback."""

import asyncio
import contextlib
import socket
import sys
from collections.abc import AsyncIterator

import pytest
import torch

from rollout_svc.weight_sync import ChunkAssembler, WeightReceiver
from tests.rollout_svc import weight_sender
from turnrl.config import REPO_ROOT
from turnrl.errors import FailedPreconditionError, InvalidArgumentError
from turnrl.weights import ALIGNMENT_BYTES, BucketedWeights, TensorMeta


def state_dict() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    return {
        "embed.weight": torch.randn(50, 16),
        "layers.0.norm.weight": torch.randn(16).to(torch.bfloat16),
        "layers.0.mlp.weight": torch.randn(32, 16).to(torch.float16),
        "scalar": torch.randn(()),
    }


def metas_of(tensors: dict[str, torch.Tensor]) -> list[TensorMeta]:
    return [TensorMeta(name, t.dtype, tuple(t.shape)) for name, t in tensors.items()]


def test_buckets_respect_the_size_and_the_order():
    metas = metas_of(state_dict())
    layout = BucketedWeights(metas, bucket_size_bytes=1024)
    assert [i for bucket in layout.buckets for i in bucket] == list(range(len(metas)))
    for index, bucket in enumerate(layout.buckets):
        # only a tensor larger than a bucket is alone
        assert layout.bucket(index).numel() <= 1024 or len(bucket) == 1
    assert len(BucketedWeights(metas, bucket_size_bytes=1 << 30).buckets) == 1


def test_every_tensor_starts_aligned_and_packing_is_exact():
    odd_bf16 = torch.randn(3).bfloat16()  # 6 bytes: the next tensor would start unaligned
    tensors = {"odd": odd_bf16, **state_dict()}
    weights = BucketedWeights.pack(tensors.items(), bucket_size_bytes=1024)
    for index, (name, tensor) in enumerate(weights.named_tensors()):
        assert tensor.data_ptr() % ALIGNMENT_BYTES == 0
        assert tensor.data_ptr() == weights.tensor(index).data_ptr()
        assert torch.equal(tensor, tensors[name]) and tensor.dtype == tensors[name].dtype
    assert weights.nbytes == sum(t.nbytes for t in tensors.values())
    bucket = weights.bucket(0)
    first = weights.named_tensors(0)[0][1]
    assert bucket.data_ptr() == first.data_ptr()  # a bucket's bytes are its tensors


def test_packing_casts_sends_tied_tensors_once_and_reuses_memory():
    embed = torch.randn(8, 4)
    tied = [("embed.weight", embed), ("norm.weight", torch.randn(4)), ("lm_head.weight", embed)]
    weights = BucketedWeights.pack(tied, 4096, dtype=torch.bfloat16)
    assert [meta.name for meta in weights.metas] == ["embed.weight", "norm.weight"]
    assert weights.tensor(0).dtype == torch.bfloat16
    assert torch.equal(weights.tensor(0), embed.bfloat16())
    again = BucketedWeights.pack(tied, 4096, dtype=torch.bfloat16, reuse=weights.data)
    assert again.data.data_ptr() == weights.data.data_ptr()
    assert again.matches(weights.metas, 4096) and not again.matches(weights.metas, 2048)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# state_dict()'s shapes and dtypes, as weight_sender specs.
SPECS = [
    "embed.weight:float32:50x16", "layers.0.norm.weight:bfloat16:16",
    "layers.0.mlp.weight:float16:32x16", "scalar:float32:",
]  # fmt: skip


@contextlib.asynccontextmanager
async def joined(
    bucket_size: int, layout: str = "aligned_buckets", updates: int = 1
) -> AsyncIterator[WeightReceiver]:
    """A receiver in a group with a trainer's rank 0 (a `weight_sender` process) that
    broadcasts `updates` updates of SPECS in `layout`; checks the sender's exit."""
    command = weight_sender.command(
        "weights", SPECS, layout=layout, bucket_size=bucket_size, updates=updates
    )
    sender = await asyncio.create_subprocess_exec(
        sys.executable, *command, cwd=REPO_ROOT, stdout=asyncio.subprocess.PIPE
    )
    receiver = WeightReceiver()
    try:
        port = int(await sender.stdout.readline())
        await receiver.join("127.0.0.1", port, 2, 1, "gloo", "weights", timeout_seconds=30)
        yield receiver
        async with asyncio.timeout(30):
            assert await sender.wait() == 0
    finally:
        receiver.leave()
        if sender.returncode is None:
            sender.kill()
            await sender.wait()


@pytest.mark.parametrize("layout", ["aligned_buckets", "per_tensor", "flattened_buckets"])
async def test_receives_a_gloo_broadcast_from_rank_zero(layout):
    tensors, bucket_size = weight_sender.sent_tensors(SPECS), 2048
    async with joined(bucket_size, layout) as receiver:
        metas = metas_of(tensors)
        buckets = [bucket async for bucket in receiver.receive("weights", metas, 2048, layout)]
    assert len(buckets) > 1
    received = [named for bucket in buckets for named in bucket]
    assert [name for name, _ in received] == list(tensors)
    for (_, got), expected in zip(received, tensors.values(), strict=True):
        assert torch.equal(got, expected) and got.dtype == expected.dtype


async def test_receives_into_a_given_layout():
    # As into an engine's own parameters: the bytes land in that memory, nowhere else.
    tensors, bucket_size = weight_sender.sent_tensors(SPECS), 2048
    place = BucketedWeights(metas_of(tensors), bucket_size)
    place.data.zero_()
    async with joined(bucket_size) as receiver:
        metas = metas_of(tensors)
        async for bucket in receiver.receive(
            "weights", metas, bucket_size, "aligned_buckets", place
        ):
            for name, tensor in bucket:
                assert tensor.data_ptr() == place.tensor(list(tensors).index(name)).data_ptr()
        with pytest.raises(ValueError, match="laid out for another update"):
            receiver.receive("weights", metas, bucket_size // 2, "aligned_buckets", place)
    for (_, got), expected in zip(place.named_tensors(), tensors.values(), strict=True):
        assert torch.equal(got, expected)


@pytest.mark.parametrize(
    ("backend", "rank", "message"),
    [("mpi", 1, "backend 'mpi'"), ("gloo", 0, "rank 0 must be in 1..1"), ("gloo", 2, "rank 2")],
)
async def test_bad_group_settings_are_invalid(backend, rank, message):
    with pytest.raises(InvalidArgumentError, match=message):
        await WeightReceiver().join("127.0.0.1", 1, 2, rank, backend, "g", timeout_seconds=1)


def test_receive_without_a_group_is_a_failed_precondition():
    # Refused at once, before an engine marks its weights as being replaced.
    with pytest.raises(FailedPreconditionError, match="no weight-sync group 'weights'"):
        WeightReceiver().receive("weights", metas_of(state_dict()), 1024, "per_tensor")


async def test_a_receiver_that_stops_early_still_receives_the_whole_update():
    # The rest of a stopped update is received and dropped, so the next one lines up.
    first, second = (weight_sender.sent_tensors(SPECS, update) for update in (0, 1))
    bucket_size = 2048
    async with joined(bucket_size, updates=2) as receiver:
        stopped = receiver.receive("weights", metas_of(first), bucket_size, "aligned_buckets")
        await anext(stopped)
        await stopped.aclose()  # as a load that fails on the first bucket does
        received = [
            named
            async for bucket in receiver.receive(
                "weights", metas_of(second), bucket_size, "aligned_buckets"
            )
            for named in bucket
        ]
    for (_, got), expected in zip(received, second.values(), strict=True):
        assert torch.equal(got, expected)


async def test_join_times_out_naming_the_address():
    with pytest.raises(TimeoutError, match=r"within 0\.5s"):
        await WeightReceiver().join(
            "127.0.0.1", free_port(), 2, 1, "gloo", "g", timeout_seconds=0.5
        )


def test_chunks_rebuild_the_tensors():
    tensors = state_dict()
    metas = metas_of(tensors)
    assembler = ChunkAssembler(metas)
    for index, tensor in enumerate(tensors.values()):
        data = tensor.contiguous().view(-1).view(torch.uint8).numpy().tobytes()
        for offset in range(0, len(data), 100):
            assembler.add(index, offset, data[offset : offset + 100])
    rebuilt = assembler.tensors()
    assert all(torch.equal(a, b) for a, (_, b) in zip(tensors.values(), rebuilt, strict=True))
    assert assembler.bytes_received == sum(m.nbytes for m in metas)


@pytest.mark.parametrize(
    ("index", "offset", "size", "message"),
    [
        (9, 0, 4, "the header has 4 tensors"),
        (0, 8, 4, "chunk at byte 8, expected 0"),
        (3, 0, 8, "exceed its 4 bytes"),
    ],
)
def test_bad_chunks_are_invalid(index, offset, size, message):
    with pytest.raises(InvalidArgumentError, match=message):
        ChunkAssembler(metas_of(state_dict())).add(index, offset, b"x" * size)


def test_missing_bytes_are_invalid():
    assembler = ChunkAssembler(metas_of(state_dict()))
    with pytest.raises(InvalidArgumentError, match=r"'embed.weight': got 0 of its 3200 bytes"):
        assembler.tensors()
