"""Chunks: packing, chunk-size search, and the tensor state machine refusing illegal transitions."""

import itertools

import pytest
import torch

from colossal.gemini import Chunk, ChunkState, IllegalTransitionError, TensorState, pack, search_chunk_size

S = TensorState
LEGAL = {
    (S.FREE, S.HOLD), (S.FREE, S.READY_FOR_REDUCE),
    (S.HOLD, S.FREE), (S.HOLD, S.COMPUTE), (S.HOLD, S.READY_FOR_REDUCE),
    (S.COMPUTE, S.HOLD), (S.COMPUTE, S.HOLD_AFTER_BWD), (S.COMPUTE, S.READY_FOR_REDUCE),
    (S.HOLD_AFTER_BWD, S.COMPUTE), (S.HOLD_AFTER_BWD, S.READY_FOR_REDUCE),
    (S.READY_FOR_REDUCE, S.HOLD), (S.READY_FOR_REDUCE, S.FREE), (S.READY_FOR_REDUCE, S.COMPUTE),
}  # fmt: skip


def _chunk(*shapes):
    chunk = Chunk(0, 64, torch.float32, torch.device("cpu"), world_size=2)
    for i, shape in enumerate(shapes):
        chunk.append(torch.nn.Parameter(torch.randn(shape)), f"p{i}")
    return chunk


def test_pack_in_order_and_search_minimises_padding():
    assert pack([3, 3, 5, 1], 6) == [[0, 1], [2, 3]]
    numels = [100, 60, 40, 100, 30, 70]
    best = search_chunk_size(numels)
    waste = len(pack(numels, best)) * best - sum(numels)
    for size in range(100, 201):
        assert waste <= len(pack(numels, size)) * size - sum(numels)
    assert search_chunk_size(numels, align=4) % 4 == 0
    with pytest.raises(ValueError, match="smaller than a parameter"):
        pack([10], 5)


@pytest.mark.parametrize("src,dst", list(itertools.product(S, S)))
def test_every_transition_is_checked(src, dst):
    chunk = _chunk((4,))
    info = chunk.tensors[0]
    info.state = src
    if (src, dst) in LEGAL:
        chunk.transition(info, dst)
        assert info.state is dst
    else:
        with pytest.raises(IllegalTransitionError, match=f"from {src.name} to {dst.name}"):
            chunk.transition(info, dst)


def test_nested_users_keep_a_tensor_computing_until_the_last_leaves():
    """A parent and its child sharing a parameter: the tensor stays COMPUTE (its chunk in use) until both left."""
    chunk = _chunk((4,))
    info = chunk.tensors[0]
    info.state = S.HOLD
    chunk.enter(info)  # the parent
    chunk.enter(info)  # its child
    assert (info.state, info.users) == (S.COMPUTE, 2)
    chunk.leave(info, S.HOLD)
    assert info.state is S.COMPUTE and chunk.in_use
    chunk.leave(info, S.HOLD)
    assert (info.state, info.users) == (S.HOLD, 0) and not chunk.in_use
    with pytest.raises(IllegalTransitionError, match="left by an operator while HOLD with 0 users"):
        chunk.leave(info, S.HOLD)


def test_chunk_cannot_be_released_while_a_tensor_computes():
    chunk = _chunk((4,), (2, 3))
    chunk.payload.untyped_storage().resize_(chunk.nbytes)
    chunk.bind()
    assert chunk.tensors[1].param.data.data_ptr() == chunk.payload.data_ptr() + 4 * 4  # views into the chunk
    chunk.to_gathered()
    assert chunk.count(S.HOLD) == 2
    chunk.transition(chunk.tensors[0], S.COMPUTE)
    with pytest.raises(IllegalTransitionError, match="COMPUTE"):
        chunk.to_released()
    chunk.transition(chunk.tensors[0], S.HOLD)
    chunk.to_released()
    assert chunk.state is ChunkState.RELEASED and chunk.count(S.FREE) == 2
    with pytest.raises(IllegalTransitionError, match="expected GATHERED"):
        chunk.to_released()
    for info in chunk.tensors:
        chunk.transition(info, S.READY_FOR_REDUCE)
    assert chunk.ready_for_reduce
    chunk.after_reduce()
    assert chunk.count(S.FREE) == 2


def test_chunk_size_must_divide_by_ranks():
    with pytest.raises(ValueError, match="divisible"):
        Chunk(0, 65, torch.float32, torch.device("cpu"), world_size=2)
