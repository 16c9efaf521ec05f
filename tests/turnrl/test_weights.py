"""BucketedWeights.pack: the copy into the push layout runs in a thread of its own, bucket by
bucket, and what reads a bucket waits for that bucket only, so that a push sends bucket k
while bucket k + 1 is copied."""

import threading
from concurrent import futures

import pytest
import torch

from turnrl.weights import BucketedWeights

BUCKET_SIZE_BYTES = 64  # one tensor of 16 floats a bucket


class GatedTensor(torch.Tensor):
    """A source tensor whose copy waits until `gate` is set (or raises `error` then)."""

    gate: threading.Event
    error: Exception | None = None

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if func is torch.Tensor.copy_:
            cls.gate.wait()
            if cls.error is not None:
                raise cls.error
        return super().__torch_function__(func, types, args, kwargs or {})


def gated(tensor: torch.Tensor, error: Exception | None = None) -> GatedTensor:
    kind = type("Gated", (GatedTensor,), {"gate": threading.Event(), "error": error})
    return tensor.as_subclass(kind)


def test_pack_returns_before_copying_and_a_bucket_is_readable_once_copied():
    first, second = torch.arange(16, dtype=torch.float32), torch.full((16,), 2.0)
    slow = gated(second)
    with futures.ThreadPoolExecutor(2) as pool:
        packing = pool.submit(BucketedWeights.pack, [("a", first), ("b", slow)], BUCKET_SIZE_BYTES)
        try:
            weights = packing.result(timeout=30)  # before: waited for the gate, so timed out
            assert len(weights.buckets) == 2
            weights.wait_packed(0)  # returns: what a push waits for before it pauses
            assert torch.equal(weights.tensor(0), first)  # bucket 0 is in: it can be sent
            reading = pool.submit(weights.bucket, 1)
            assert not futures.wait([reading], timeout=0.2).done  # bucket 1 is not
        finally:
            type(slow).gate.set()
        assert torch.equal(reading.result(timeout=30).view(torch.float32), second)
    weights.wait_packed()
    assert torch.equal(weights.tensor(1), second)


def test_a_failed_copy_fails_whoever_reads_the_bucket():
    source = gated(torch.ones(16), error=RuntimeError("no memory"))
    type(source).gate.set()
    weights = BucketedWeights.pack([("a", torch.zeros(16)), ("b", source)], BUCKET_SIZE_BYTES)
    with pytest.raises(RuntimeError, match="packing the weights failed: RuntimeError\\('no memory"):
        weights.wait_packed()
    with pytest.raises(RuntimeError, match="packing the weights failed"):
        weights.tensor(1)


def test_an_update_built_to_receive_into_needs_no_packing():
    weights = BucketedWeights.pack([("a", torch.ones(16))], BUCKET_SIZE_BYTES)
    receiving = BucketedWeights(weights.metas, BUCKET_SIZE_BYTES)
    receiving.wait_packed()
    receiving.bucket(0).copy_(weights.bucket(0))
    assert torch.equal(receiving.tensor(0), torch.ones(16))
