"""The hf engine's batch KV cache: rows keep their own KV, unpadded, through joining, leaving,
decode steps and buffer growth; padding stays finite."""

import torch

from rollout_svc.engines.hf_cache import MIN_BUFFER_COLUMNS, BatchKv, Kv

LAYERS, HEADS, HEAD_DIM = 2, 2, 4


def random_kv(tokens: int, seed: int) -> Kv:
    generator = torch.Generator().manual_seed(seed)
    return [
        (
            torch.randn(1, HEADS, tokens, HEAD_DIM, generator=generator),
            torch.randn(1, HEADS, tokens, HEAD_DIM, generator=generator),
        )
        for _ in range(LAYERS)
    ]


def step(batch: BatchKv, seed: int) -> Kv:
    """Writes one new column to every row, as a decode forward does; returns it per row."""
    batch.reserve(0, 1)
    column = random_kv(batch.rows, seed)  # row i of the step is column[layer][.][0, :, i]
    for layer, (keys, values) in enumerate(column):
        batch.cache.update(keys.transpose(0, 2), values.transpose(0, 2), layer)
    return [
        [(keys[:, :, row : row + 1], values[:, :, row : row + 1]) for keys, values in column]
        for row in range(batch.rows)
    ]


def joined(kv: Kv | None, new: Kv) -> Kv:
    if kv is None:
        return new
    return [
        (torch.cat([k, nk], dim=2), torch.cat([v, nv], dim=2))
        for (k, v), (nk, nv) in zip(kv, new, strict=True)
    ]


def assert_rows(batch: BatchKv, expected: list[Kv | None]) -> None:
    assert batch.rows == len(expected)
    width = batch.width
    for row, kv in enumerate(expected):
        if kv is None:
            assert all(keys.shape[-2] == 0 for keys, _ in batch.row_kv(row, slice(width, width)))
            continue
        got = batch.row_kv(row, slice(width - kv[0][0].shape[-2], width))
        for (keys, values), (want_keys, want_values) in zip(got, kv, strict=True):
            assert torch.equal(keys, want_keys) and torch.equal(values, want_values)
    for layer in batch.cache.layers:
        assert torch.isfinite(layer.keys_buffer).all() and torch.isfinite(layer.values_buffer).all()


def test_rows_keep_their_kv_through_joins_leaves_steps_and_growth() -> None:
    batch = BatchKv(random_kv(1, seed=0), max_rows=4, max_columns=4 * MIN_BUFFER_COLUMNS)
    rows: list[Kv | None] = [random_kv(5, seed=1), None, random_kv(3, seed=2)]
    batch.append(rows)
    assert batch.width == 5
    assert_rows(batch, rows)

    rows = [joined(kv, column) for kv, column in zip(rows, step(batch, seed=3), strict=True)]
    assert batch.width == 6
    assert_rows(batch, rows)

    # The longest row leaves: the last row takes its slot and the batch narrows to 4 columns.
    assert batch.remove([0], width=4) == [2, 1]
    rows = [rows[2], rows[1]]
    assert batch.width == 4
    assert_rows(batch, rows)

    # A row longer than the batch joins, then steps run past the buffer's first capacity.
    rows.append(random_kv(MIN_BUFFER_COLUMNS, seed=6))
    batch.append([rows[-1]])
    assert batch.width == MIN_BUFFER_COLUMNS
    nbytes = batch.nbytes()
    for seed in range(7, 7 + MIN_BUFFER_COLUMNS + 1):
        rows = [joined(kv, c) for kv, c in zip(rows, step(batch, seed), strict=True)]
    assert batch.width == 2 * MIN_BUFFER_COLUMNS + 1
    assert batch.nbytes() > nbytes
    assert_rows(batch, rows)

    assert batch.remove([0, 1, 2], width=0) == []
    assert batch.width == 0
    batch.clear()
    assert (batch.rows, batch.nbytes()) == (0, 0)


def test_a_row_longer_than_the_running_ones_joins_into_the_spare_columns() -> None:
    batch = BatchKv(random_kv(1, seed=0), max_rows=4, max_columns=4 * MIN_BUFFER_COLUMNS)
    rows: list[Kv | None] = [random_kv(8, seed=1)]
    batch.append(rows)
    buffers = [layer.keys_buffer for layer in batch.cache.layers]
    spare = buffers[0].shape[-2] - batch.width

    # Half the spare columns lie before the rows' end: a row that much longer joins in place.
    rows.append(random_kv(batch.width + spare // 2, seed=2))
    batch.append([rows[-1]])
    layers = batch.cache.layers
    assert all(layer.keys_buffer is buffer for layer, buffer in zip(layers, buffers, strict=True))
    assert_rows(batch, rows)
    rows = [joined(kv, column) for kv, column in zip(rows, step(batch, seed=3), strict=True)]
    assert_rows(batch, rows)

    # One longer still takes new buffers, the rows moved into them whole.
    rows.append(random_kv(batch.width + 1, seed=4))
    batch.append([rows[-1]])
    assert batch.cache.layers[0].keys_buffer is not buffers[0]
    assert_rows(batch, rows)
