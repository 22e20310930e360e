"""The heads of a stored context's layer as row storages (``batch = heads = 1``), in tensors of
their own: the unit :func:`kv_cache.cache.stack.stack_sessions` stacks.

A rectangular layout gives :meth:`~kv_cache.cache.storage.LayerStorage.row`. A layer whose heads
hold different numbers of tokens (a shared budget: KVzip's model-wide one, KVzap's threshold) is
held in the packed ragged layout (:class:`~kv_cache.cache.packed_ragged.PackedRaggedStorage`): row
``h`` is then the head's sinks (the tail's, rectangular), its full-precision tokens in the
buffer and the tail's residual (full precision), and its packed tokens in the buffer and the
tail's packed ones (one :class:`~kv_cache.cache.packed.PackedKV` with the key scale groups they
use). The tokens and codes are copied as held, never re-quantized; their order inside a row
differs from token order where the buffer's full-precision tokens precede packed ones, which
attention does not see (a softmax over a set of keys, each at its absolute position).
"""

from __future__ import annotations

import torch

from .packed import PackedKV
from .packed_ragged import PackedRaggedStorage, _concat_packed, _offsets
from .ragged import RaggedStorage
from .storage import FullPrecisionStorage, LayerStorage, QuantizedStorage

ROW_LAYOUTS = (FullPrecisionStorage, QuantizedStorage, PackedRaggedStorage, RaggedStorage)
"""The layouts whose batch-1 layers :func:`head_rows` splits."""


def _slice_packed(packed: PackedKV, first: int, n: int) -> PackedKV:
    """Tokens ``[first, first + n)`` of a one-row packed buffer as a :class:`PackedKV` of its own
    (``[1, 1, n, ...]``, only the key scale groups they use); the buffer is not changed."""
    out = PackedKV.__new__(PackedKV)
    out.__dict__.update({k: v for k, v in packed.__dict__.items() if k != PackedKV._BLOCKS})
    out.gather(torch.arange(first, first + n, device=packed.k_codes.device).reshape(1, 1, -1))
    return out


def _ragged_row(st: PackedRaggedStorage, h: int, fp_off: int, q_off: int) -> LayerStorage:
    """Head ``h`` of a batch-1 packed ragged layer (``fp_off`` / ``q_off``: where it starts in the buffers)."""
    f, q, tail = st.fp_len[h], st.q_len[h], st.tail
    keys = [] if not f else [st.fp_keys[:, :, fp_off:fp_off + f]]
    values = [] if not f else [st.fp_values[:, :, fp_off:fp_off + f]]
    if isinstance(tail, FullPrecisionStorage):
        keys.append(tail.keys[:, h:h + 1])
        values.append(tail.values[:, h:h + 1])
        return FullPrecisionStorage(torch.cat(keys, dim=2).clone(), torch.cat(values, dim=2).clone())
    row = QuantizedStorage.__new__(QuantizedStorage)
    row.quant, row.dtype = tail.quant, tail.dtype
    row.sink_keys = None if tail.sink_keys is None else tail.sink_keys[:, h:h + 1].clone()
    row.sink_values = None if tail.sink_values is None else tail.sink_values[:, h:h + 1].clone()
    row.keys = torch.cat(keys + [tail.keys[:, h:h + 1]], dim=2).clone()
    row.values = torch.cat(values + [tail.values[:, h:h + 1]], dim=2).clone()
    parts = ([_slice_packed(st.packed, q_off, q)] if q else []) + (
        [tail.packed.row(0, h)] if tail.packed.length else [])
    if not parts:
        row.packed = PackedKV(tail.quant, tail.dtype, tail.packed.head_dim, True, tail.packed.layer)
        return row
    row.packed = parts[0] if len(parts) == 1 else _concat_packed(parts)
    rotation = st.rotation if st.rotation is not None else tail.packed.rotation
    row.packed.rotation = None if rotation is None else rotation.head(h)
    return row


def head_rows(storage: LayerStorage) -> list[LayerStorage]:
    """The ``heads`` rows of a batch-1 layer (one of :data:`ROW_LAYOUTS`), copies in token order
    but for the ragged layouts' buffers (see the module docstring)."""
    if storage.batch != 1:
        raise ValueError(f"head_rows splits a batch-1 layer; this one holds {storage.batch} rows")
    if isinstance(storage, (FullPrecisionStorage, QuantizedStorage)):
        return [storage.row(0, h) for h in range(storage.heads)]
    if isinstance(storage, RaggedStorage):
        return [row.row(0, 0) for row in storage.rows]
    if isinstance(storage, PackedRaggedStorage):
        fp, q = _offsets(storage.fp_len).tolist(), _offsets(storage.q_len).tolist()
        return [_ragged_row(storage, h, fp[h], q[h]) for h in range(storage.heads)]
    raise ValueError(f"head_rows splits {', '.join(c.__name__ for c in ROW_LAYOUTS)}; got {type(storage).__name__}")


__all__ = ["ROW_LAYOUTS", "head_rows"]
