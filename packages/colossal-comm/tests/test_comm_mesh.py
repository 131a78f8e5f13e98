"""Mesh axes and the 2D / 2.5D / 3D layouts hold exactly the documented members.

Expected members are recomputed here from the documented index formulas (independently of the
DeviceMesh-based construction) and compared with the groups' real membership.
"""

import itertools

import pytest
import torch.distributed as dist

import colossal.comm as cc
from colossal.comm.testing import run_distributed


def _members(group) -> list[int]:
    return dist.get_process_group_ranks(group)


def mesh_axes(axes: dict) -> dict:
    mesh = cc.Mesh(axes=axes)
    return {a: (mesh.coordinate(a), mesh.ranks(a), mesh.size(a)) for a in mesh.names} | {
        "_product": _members(mesh.product_group(*mesh.names[:2])) if len(mesh.names) > 1 else None
    }


def _row_major(shape: tuple[int, ...]):
    return list(itertools.product(*(range(s) for s in shape)))


@pytest.mark.parametrize(
    "axes, sizes",
    [({"dp": 2, "tp": 4}, (2, 4)), ({"dp": -1, "pp": 2, "tp": 2}, (2, 2, 2)), ({"sp": 8}, (8,))],
)
def test_mesh_axes_are_row_major(axes, sizes):
    out = run_distributed(mesh_axes, 8, axes)
    coords = _row_major(sizes)
    names = list(axes)
    for rank, info in enumerate(out):
        for i, name in enumerate(names):
            coord, ranks, size = info[name]
            assert coord == coords[rank][i] and size == sizes[i]
            expect = [
                q for q, c in enumerate(coords) if all(c[j] == coords[rank][j] for j in range(len(sizes)) if j != i)
            ]
            assert ranks == expect, (rank, name)
        if len(names) > 1:
            expect = [q for q, c in enumerate(coords) if c[2:] == coords[rank][2:]]
            assert info["_product"] == expect


def layouts_8() -> dict:
    out = {}
    m = cc.Mesh(axes={"dp": 2, "tp": 4})
    l2 = m.layout("2d")
    out["2d"] = (l2.q, l2.row_index, l2.col_index, _members(l2.row), _members(l2.col))
    l25 = m.layout("2.5d", depth=1)
    out["2.5d_d1"] = (
        l25.row_index,
        l25.col_index,
        l25.dep_index,
        _members(l25.row),
        _members(l25.col),
        _members(l25.dep),
        _members(l25.xz),
    )
    m8 = cc.Mesh(axes={"tp": 8})
    l25 = m8.layout("2.5d", depth=2)
    out["2.5d_d2"] = (
        l25.row_index,
        l25.col_index,
        l25.dep_index,
        _members(l25.row),
        _members(l25.col),
        _members(l25.dep),
        _members(l25.xz),
    )
    l3 = m8.layout("3d")
    out["3d"] = (
        l3.input_index,
        l3.weight_index,
        l3.output_index,
        *(_members(g) for g in (l3.input, l3.weight, l3.output, l3.input_x_weight, l3.output_x_weight)),
    )
    assert m8.layout("3d") is l3  # cached: built once
    return out


def _2p5d_expect(idx: int, q: int, d: int, base: int):
    k, i, j = idx // (q * q), idx // q % q, idx % q
    at = lambda kk, ii, jj: base + kk * q * q + ii * q + jj
    return (
        i,
        j,
        k,
        [at(k, i, jj) for jj in range(q)],
        [at(k, ii, j) for ii in range(q)],
        [at(kk, i, j) for kk in range(d)],
        [at(kk, ii, j) for kk in range(d) for ii in range(q)],
    )


def test_layouts_match_documented_orderings():
    out = run_distributed(layouts_8, 8)
    for rank, info in enumerate(out):
        base, idx = (rank // 4) * 4, rank % 4
        i, j = idx // 2, idx % 2
        assert info["2d"] == (2, i, j, [base + i * 2 + jj for jj in range(2)], [base + ii * 2 + j for ii in range(2)])
        assert info["2.5d_d1"] == _2p5d_expect(idx, 2, 1, base)
        assert info["2.5d_d2"] == _2p5d_expect(rank, 2, 2, 0)
        a, b, c = rank // 4, rank // 2 % 2, rank % 2
        at = lambda aa, bb, cc_: aa * 4 + bb * 2 + cc_
        assert info["3d"] == (
            a,
            b,
            c,
            [at(x, b, c) for x in range(2)],
            [at(a, x, c) for x in range(2)],
            [at(a, b, x) for x in range(2)],
            [at(x, y, c) for x in range(2) for y in range(2)],
            [at(a, x, y) for x in range(2) for y in range(2)],
        )


def bad_meshes() -> list[str]:
    """Every bad shape raises ValueError on every rank, before any collective."""
    messages = []
    with cc.CommCounter() as counter:
        for axes, kind in [
            ({"dp": 3, "tp": 2}, None),
            ({"dp": -1, "tp": -1}, None),
            ({"dp": 0, "tp": 4}, None),
            ({"dp": -1, "tp": 3}, None),
            ({"tp": 4}, ("3d", 1)),
            ({"tp": 4}, ("2.5d", 2)),
            ({"dp": 2, "tp": 2}, ("2d", 1)),
        ]:
            try:
                mesh = cc.Mesh(axes=axes)
                mesh.layout(kind[0], depth=kind[1])
            except ValueError as e:
                messages.append(str(e))
    assert counter.calls == {}, "validation must not communicate"
    dist.barrier()  # every rank is still in step
    return messages


def test_bad_sizes_raise_value_error_on_every_rank():
    out = run_distributed(bad_meshes, 4)
    assert all(len(m) == 7 for m in out) and all(m == out[0] for m in out)
    assert "multiply to 6" in out[0][0] and "world size is 4" in out[0][0]
    assert "only one axis may be -1" in out[0][1]
    assert "'dp' has size 0" in out[0][2]
    assert "cannot infer axis 'dp'" in out[0][3]
    assert "3d layout" in out[0][4] and "got 4" in out[0][4]
    assert "q*q*d" in out[0][5]
    assert "2d layout" in out[0][6] and "got 2" in out[0][6]


def unknown_axis() -> str:
    try:
        cc.Mesh(axes={"dp": 2}).group("tp")
    except ValueError as e:
        return str(e)
    return ""


def test_unknown_axis_is_named():
    assert "unknown mesh axis 'tp'" in run_distributed(unknown_axis, 2)[0]
