"""The hf engine's KV caches: the running batch's, and finished requests' by session.

`BatchKv` holds the KV of a batch's rows left-padded (right-aligned): every row ends at the same
column, so one forward writes its columns after all rows at once (one per decode step; a
prefill's new tokens, right-padded). The columns live in per-layer buffers with room to spare,
and `BatchKvLayer.update` writes the forward's keys and values into that room in place, where
transformers' `DynamicLayer` would `torch.cat` the whole cache every step. Rows keep their
buffer slot while they run: a joining request takes the next free slot, a leaving one's slot is
filled by the last row, so joining and leaving copy only the rows that move.

Padding columns are never attended (the engine's attention mask hides them) but they are
multiplied by zero attention weights, so they must hold finite numbers: buffers start zeroed
and are only ever written with the model's keys and values.
"""

from collections import OrderedDict
from dataclasses import dataclass

import torch
from transformers.cache_utils import Cache, DynamicLayer

# Per layer: (keys, values), each [1, kv_heads, tokens, head_dim].
Kv = list[tuple[torch.Tensor, torch.Tensor]]

# The fewest columns a batch buffer is allocated with; it grows to twice what it needs.
MIN_BUFFER_COLUMNS = 64


def kv_bytes(kv: Kv) -> int:
    """Bytes of the keys and values of `kv`."""
    return sum(keys.nbytes + values.nbytes for keys, values in kv)


@dataclass
class _SessionKv:
    token_ids: list[int]  # the tokens the KV covers
    kv: Kv
    nbytes: int
    # (first token, bytes' SHA-256) of each image among them: alike image tokens of two
    # images are not one prefix.
    images: tuple[tuple[int, str], ...] = ()

    def shared_prefix(self, token_ids: list[int], images: tuple[tuple[int, str], ...]) -> int:
        """How many first tokens of `token_ids` (holding `images`) this KV covers as they are:
        up to the first token or the first image that differs."""
        limit = min(len(self.token_ids), len(token_ids))
        shared = next((i for i in range(limit) if self.token_ids[i] != token_ids[i]), limit)
        for mine, theirs in zip(self.images, images, strict=False):
            if mine != theirs:
                return min(shared, mine[0], theirs[0])
        # An image beyond the other's last one starts where the shared tokens stop being so.
        extra = self.images[len(images) :] or images[len(self.images) :]
        return min(shared, extra[0][0]) if extra else shared


class SessionKvStore:
    """Finished requests' KV by session, least recently used first, within a byte budget."""

    def __init__(self, budget_bytes: int):
        self._budget_bytes = budget_bytes
        self._entries: OrderedDict[str, _SessionKv] = OrderedDict()
        self.nbytes = 0
        self.evictions = 0

    def __len__(self) -> int:
        return len(self._entries)

    def put(
        self,
        session_id: str,
        token_ids: list[int],
        kv: Kv,
        images: tuple[tuple[int, str], ...] = (),
    ) -> None:
        self.pop(session_id)
        entry = _SessionKv(token_ids, kv, kv_bytes(kv), images)
        self._entries[session_id] = entry
        self.nbytes += entry.nbytes
        while self.nbytes > self._budget_bytes:
            _, evicted = self._entries.popitem(last=False)
            self.nbytes -= evicted.nbytes
            self.evictions += 1

    def pop(self, session_id: str) -> _SessionKv | None:
        entry = self._entries.pop(session_id, None)
        if entry is not None:
            self.nbytes -= entry.nbytes
        return entry

    def clear(self) -> None:
        self._entries.clear()
        self.nbytes = 0


class BatchKvLayer(DynamicLayer):
    """One layer of a `BatchKv`: `keys` and `values` are views of the buffers' rows in use,
    columns [start, end); `update` writes new columns at `end` in place."""

    def __init__(self, keys_buffer: torch.Tensor, values_buffer: torch.Tensor):
        super().__init__()
        self.keys_buffer, self.values_buffer = keys_buffer, values_buffer
        self.is_initialized = True
        self.device = keys_buffer.device
        self.set_view(rows=0, start=0, end=0)

    def set_view(self, rows: int, start: int, end: int) -> None:
        self.rows, self.start, self.end = rows, start, end
        self.keys = self.keys_buffer[:rows, :, start:end]
        self.values = self.values_buffer[:rows, :, start:end]

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # BatchKv.reserve made room for the step's columns before the forward.
        end = self.end + key_states.shape[-2]
        self.keys_buffer[: self.rows, :, self.end : end] = key_states
        self.values_buffer[: self.rows, :, self.end : end] = value_states
        self.set_view(self.rows, self.start, end)
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self.end - self.start


class BatchKv:
    """A batch's KV in buffers of `max_rows` rows. A row joins with its KV right-aligned (its
    `kv_len` tokens are the columns [width - kv_len, width) of `cache`, padding before them);
    a forward over `cache` appends columns to every row."""

    def __init__(self, layout: Kv, max_rows: int, max_columns: int):
        """`layout`: one (keys, values) pair per layer, whose heads, head size, dtype and device
        the buffers take; `max_columns`: the widest the batch can get (max_model_len)."""
        self._layout = layout
        self._max_rows = max_rows
        self._max_columns = max_columns
        self.rows = 0
        self.cache: Cache | None = None  # None until the first row joins

    @property
    def width(self) -> int:
        return self.cache.get_seq_length() if self.cache is not None else 0

    def _layers(self) -> list[BatchKvLayer]:
        return self.cache.layers if self.cache is not None else []

    def nbytes(self) -> int:
        """Bytes of the buffers, spare rows and columns included."""
        return sum(
            layer.keys_buffer.nbytes + layer.values_buffer.nbytes for layer in self._layers()
        )

    def reserve(self, width: int, new_columns: int) -> None:
        """Makes room for `width` columns up to the current end (for a joining row that long)
        and `new_columns` after it (for a forward's keys and values). When the buffers have too
        little room they are replaced by larger ones holding the rows in use, right-aligned."""
        layers, old_width = self._layers(), self.width
        width = max(width, old_width)
        if layers and width <= layers[0].end <= layers[0].keys_buffer.shape[-2] - new_columns:
            return
        columns = min(max(2 * (width + new_columns), MIN_BUFFER_COLUMNS), self._max_columns)
        columns = max(columns, width + new_columns)
        # Half the spare columns go before the rows' end: a returning turn's request, longer than
        # every running one, then joins without another copy of the whole batch.
        end = width + (columns - width - new_columns) // 2
        fresh = []
        for index, (keys, values) in enumerate(self._layout):
            buffers = [
                tensor.new_zeros((self._max_rows, tensor.shape[1], columns, tensor.shape[3]))
                for tensor in (keys, values)
            ]
            if layers:
                buffers[0][: self.rows, :, end - old_width : end] = layers[index].keys
                buffers[1][: self.rows, :, end - old_width : end] = layers[index].values
            fresh.append(BatchKvLayer(*buffers))
            fresh[-1].set_view(self.rows, end - width, end)
        self.cache = Cache(layers=fresh)

    def append(self, rows: list[Kv | None]) -> None:
        """Adds rows after the last one, each with its KV ([1, heads, kv_len, head_dim] per
        layer), or None when it has none yet."""
        kv_lens = [kv[0][0].shape[-2] if kv else 0 for kv in rows]
        width = max([self.width, *kv_lens])
        self.reserve(width, 0)
        for index, layer in enumerate(self._layers()):
            for row, (kv, kv_len) in enumerate(zip(rows, kv_lens, strict=True), self.rows):
                if kv_len:
                    keys, values = kv[index]
                    layer.keys_buffer[row, :, layer.end - kv_len : layer.end] = keys[0]
                    layer.values_buffer[row, :, layer.end - kv_len : layer.end] = values[0]
            layer.set_view(self.rows + len(rows), layer.end - width, layer.end)
        self.rows += len(rows)

    def row_kv(self, row: int, columns: slice) -> Kv:
        """Views of row `row`'s keys and values over `columns` of the batch's width."""
        return [
            (layer.keys[row : row + 1, :, columns], layer.values[row : row + 1, :, columns])
            for layer in self._layers()
        ]

    def remove(self, rows: list[int], width: int) -> list[int]:
        """Takes rows out, moving the last rows into the freed slots, and narrows the batch to
        `width` columns (the longest kv_len left: the columns before it only leavers used).
        Returns, for each row left, the row it was."""
        kept = self.rows - len(rows)
        holes = sorted(row for row in rows if row < kept)
        movers = [row for row in range(kept, self.rows) if row not in rows]
        order = list(range(kept))
        for hole, mover in zip(holes, movers, strict=True):
            order[hole] = mover
        layers = self._layers()
        if holes:
            to_rows = torch.tensor(holes, device=layers[0].device)
            from_rows = torch.tensor(movers, device=layers[0].device)
            for layer in layers:
                for buffer in (layer.keys_buffer, layer.values_buffer):
                    columns = slice(layer.start, layer.end)
                    buffer[to_rows, :, columns] = buffer[from_rows, :, columns]
        self.rows = kept
        for layer in layers:
            layer.set_view(kept, layer.end - width, layer.end)
        return order

    def clear(self) -> None:
        """Drops every row and the buffers."""
        self.rows, self.cache = 0, None
