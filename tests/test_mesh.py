import jax
import numpy as np
import pytest
from jax.sharding import AxisType

import shardkit as sk


@pytest.mark.parametrize("spec,expected", [
    ("data=8", {"data": 8}),
    ("data=2,tensor=4", {"data": 2, "tensor": 4}),
    ({"data": 4, "tensor": 2}, {"data": 4, "tensor": 2}),
    ([("data", 2), ("fsdp", 2), ("tensor", 2)], {"data": 2, "fsdp": 2, "tensor": 2}),
    ("data=-1,tensor=2", {"data": 4, "tensor": 2}),
    (" data = 2 , tensor=4 ", {"data": 2, "tensor": 4}),
])
def test_make_mesh_forms(spec, expected):
    mesh = sk.make_mesh(spec)
    assert dict(mesh.shape) == expected
    assert all(t == AxisType.Auto for t in mesh.axis_types)
    assert sorted(d.id for d in mesh.devices.flat) == list(range(8))


@pytest.mark.parametrize("spec,match", [
    ("data=3", r"needs 3 devices .* but 8 are available"),
    ("data=-1,tensor=-1", r"at most one axis can be inferred"),
    ("data=2,data=4", r"more than once"),
    ("data=two", r"sizes are integers"),
    ("data=0,tensor=8", r"sizes are positive"),
    ("=8", r"not an identifier"),
    ("data", r"not 'axis=size'"),
    ("", r"names no axes"),
    ("data=-1,tensor=3", r"not divisible by the other axes' product 3"),
    ({"data": 2.5}, r"sizes are integers"),
])
def test_malformed_mesh_specs(spec, match):
    with pytest.raises(ValueError, match=match):
        sk.make_mesh(spec)


def test_mesh_on_a_subset_of_devices():
    mesh = sk.make_mesh("pipe=4", devices=jax.devices()[:4])
    assert [d.id for d in mesh.devices.flat] == [0, 1, 2, 3]


def test_dcn_axes_are_outermost_and_merge_with_same_name():
    # Two simulated "slices" of 4 devices: a dcn axis of its own comes first ...
    mesh = sk.make_mesh("fsdp=2,tensor=2", dcn="replica=2")
    assert mesh.axis_names == ("replica", "fsdp", "tensor")
    ids = np.vectorize(lambda d: d.id)(mesh.devices)
    assert set(ids[0].flat) == {0, 1, 2, 3} and set(ids[1].flat) == {4, 5, 6, 7}
    # ... and a dcn axis named like an ICI axis multiplies it, slice-major.
    merged = sk.make_mesh("data=2,tensor=2", dcn="data=2")
    assert dict(merged.shape) == {"data": 4, "tensor": 2}
    mids = np.vectorize(lambda d: d.id)(merged.devices)
    assert set(mids[:2].flat) == {0, 1, 2, 3}  # first half of 'data' is slice 0


def test_use_cpu_devices_after_start_names_the_problem():
    sk.use_cpu_devices(8)  # same count: fine
    with pytest.raises(RuntimeError, match=r"already started with 8 cpu device\(s\).*before the first JAX operation"):
        sk.use_cpu_devices(4)
    with pytest.raises(ValueError, match="positive integer"):
        sk.use_cpu_devices(0)


def test_describe_mesh_lists_the_grid():
    text = sk.describe_mesh(sk.make_mesh("data=2,tensor=4"))
    assert "data=2 x tensor=4" in text and "data=1 -> tensor: [4, 5, 6, 7]" in text
