"""reshard_plan against the single-process oracle: `jax.device_put` to the receiver's sharding."""

import itertools
import os

if "jax" not in os.sys.modules:  # a fresh process: give it 8 CPU devices
    os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from h2jax.transport.reshard import (
    Layout,
    apply_local,
    broadcast_plan,
    bytes_per_dst_group,
    reshard_plan,
    total_bytes,
)

SIZES = (1, 2, 4, 8)
MESHES = [(d, t) for d, t in itertools.product(SIZES, SIZES) if d * t <= 8]
SHAPE = (8, 3, 16)  # [micro_batch, seq, d_model]: divisible by every data and tensor size


def _mesh(data, tensor, from_end=False):
    n = data * tensor
    devices = jax.devices()
    if n > len(devices):
        pytest.skip(f"needs {n} devices, have {len(devices)}")
    chosen = devices[-n:][::-1] if from_end else devices[:n]  # receiver on other devices
    return Mesh(np.array(chosen).reshape(data, tensor), ("data", "tensor"))


def _sharding(data, tensor, spec=P("data", None, "tensor"), from_end=False):
    return NamedSharding(_mesh(data, tensor, from_end), spec)


def _blocks_by_position(array, sharding):
    by_device = {s.device: np.asarray(s.data) for s in array.addressable_shards}
    return {pos: by_device[d] for pos, d in enumerate(sharding.mesh.devices.reshape(-1))}


def _assemble(blocks, sharding, shape):
    devices = sharding.mesh.devices.reshape(-1)
    arrays = [jax.device_put(blocks[pos], d) for pos, d in enumerate(devices)]
    return jax.make_array_from_single_device_arrays(shape, sharding, arrays)


def _run(src_sharding, dst_sharding, plan_fn):
    x = np.random.default_rng(0).standard_normal(SHAPE).astype(np.float32)
    src_array = jax.device_put(x, src_sharding)
    src, dst = Layout.from_sharding(src_sharding), Layout.from_sharding(dst_sharding)
    transfers = plan_fn(src, dst, SHAPE, 4)
    blocks = apply_local(transfers, src, dst, _blocks_by_position(src_array, src_sharding), SHAPE, np.float32)
    received = _assemble(blocks, dst_sharding, SHAPE)
    oracle = jax.device_put(x, dst_sharding)
    for got, want in zip(received.addressable_shards, oracle.addressable_shards):
        assert got.device == want.device and got.index == want.index
        np.testing.assert_array_equal(np.asarray(got.data), np.asarray(want.data))
    np.testing.assert_array_equal(np.asarray(received), x)
    return src, dst, transfers


@pytest.mark.parametrize("dst_mesh", MESHES, ids=lambda m: f"dst{m[0]}x{m[1]}")
@pytest.mark.parametrize("src_mesh", MESHES, ids=lambda m: f"src{m[0]}x{m[1]}")
def test_topology_aware_matches_device_put_and_moves_each_element_once(src_mesh, dst_mesh):
    src_sharding, dst_sharding = _sharding(*src_mesh), _sharding(*dst_mesh, from_end=True)
    src, dst, transfers = _run(src_sharding, dst_sharding, reshard_plan)
    size = int(np.prod(SHAPE)) * 4
    assert total_bytes(transfers) == size
    assert bytes_per_dst_group(transfers, dst) == {g: size // dst.data for g in range(dst.data)}
    # Every receiving device gets exactly its own block, nothing more.
    per_device = {p: 0 for p in range(dst.size)}
    for t in transfers:
        per_device[t.dst_pos] += t.nbytes
    assert set(per_device.values()) == {size // dst.size}

    _, _, naive = _run(src_sharding, dst_sharding, broadcast_plan)
    assert total_bytes(naive) == dst.tensor * total_bytes(transfers)
    assert bytes_per_dst_group(naive, dst) == {g: dst.tensor * size // dst.data for g in range(dst.data)}


@pytest.mark.parametrize("src_mesh", [(1, 4), (2, 2), (1, 8), (4, 2)], ids=str)
def test_replicated_sender_spreads_pieces_over_its_replicas(src_mesh):
    # After a row-parallel matmul the output is replicated over `tensor`: every replica can
    # serve every piece, so no replica may be left idle while another sends everything.
    src_sharding = _sharding(*src_mesh, spec=P("data", None, None))
    dst_sharding = _sharding(2, 2, from_end=True)
    src, dst, transfers = _run(src_sharding, dst_sharding, reshard_plan)
    size = int(np.prod(SHAPE)) * 4
    assert total_bytes(transfers) == size
    load = {p: 0 for p in range(src.size)}
    for t in transfers:
        load[t.src_pos] += t.nbytes
    assert max(load.values()) == size // src.size == min(load.values())
    # The naive plan uses a single sender per region and is not balanced.
    _, _, naive = _run(src_sharding, dst_sharding, broadcast_plan)
    senders = {t.src_pos for t in naive}
    assert len(senders) == src.data


def test_receiver_replicated_over_data_gets_the_whole_array_per_group():
    src_sharding = _sharding(2, 2)
    dst_sharding = _sharding(2, 2, spec=P(None, None, "tensor"), from_end=True)
    _, dst, transfers = _run(src_sharding, dst_sharding, reshard_plan)
    size = int(np.prod(SHAPE)) * 4
    assert bytes_per_dst_group(transfers, dst) == {0: size, 1: size}


@pytest.mark.parametrize("mesh", MESHES, ids=str)
@pytest.mark.parametrize("spec", [P("data", None, "tensor"), P(("data", "tensor")), P(None, None, ("tensor", "data"))], ids=str)
def test_layout_blocks_match_jax_index_map(mesh, spec):
    sharding = _sharding(*mesh, spec=spec)
    layout = Layout.from_sharding(sharding)
    expected = sharding.devices_indices_map(SHAPE)
    for pos, device in enumerate(sharding.mesh.devices.reshape(-1)):
        got = layout.block(pos, SHAPE)
        want = tuple(slice(s.start or 0, n if s.stop is None else s.stop) for s, n in zip(expected[device], SHAPE))
        assert got == want


def test_indivisible_shape_names_the_dimension():
    with pytest.raises(ValueError, match="dimension 2 of shape"):
        Layout(1, 3).block(0, (2, 4, 16))
