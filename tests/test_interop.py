"""Interop: weights exported from a zerojax checkpoint load into a plain Flax model on one
device; a Hugging Face style safetensors file initialises a zerojax state shard by shard."""

import json
import struct

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from common import CFG, MODEL, batches, initial_state, train_step
from flax import serialization
from flax.training import train_state

import zerojax as zj
import zerojax.io.interop as interop

TX = lambda: optax.adamw(1e-3, eps=1e-5)
DATA = batches(4)


def hf_name(path: str) -> str:
    """Our parameter paths as a PyTorch-style checkpoint would name them."""
    return "transformer." + path.replace("/", ".").replace("kernel", "weight")


def stored_transposed(path: str) -> bool:
    """Dense kernels: torch's Linear stores (out, in), Flax's Dense (in, out)."""
    return path.endswith("kernel") and "attention" not in path.lower()


def write_safetensors(path, tensors: dict):
    """A minimal Hugging Face safetensors writer (header JSON, then raw little-endian data)."""
    header, offset, blobs = {"__metadata__": {"format": "pt"}}, 0, []
    for name, array in tensors.items():
        raw = np.ascontiguousarray(array).tobytes()
        header[name] = {
            "dtype": {"float32": "F32", "bfloat16": "BF16"}[str(array.dtype)],
            "shape": list(array.shape),
            "data_offsets": [offset, offset + len(raw)],
        }
        offset += len(raw)
        blobs.append(raw)
    text = json.dumps(header).encode()
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text + b"".join(blobs))


@pytest.fixture(scope="module")
def hf_file(tmp_path_factory):
    """Pretrained-looking weights (another seed than the zerojax init), saved HF style."""
    params = initial_state(TX(), 7).params
    tensors = {}
    for p, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
        path = "/".join(str(k.key) for k in p)
        x = np.asarray(leaf)
        tensors[hf_name(path)] = x.T if stored_transposed(path) else x
    file = tmp_path_factory.mktemp("hf") / "model.safetensors"
    write_safetensors(file, tensors)
    return str(file), params


def test_hf_file_loads_shard_by_shard_and_trains_like_one_device(hf_file, monkeypatch):
    file, want = hf_file
    reads = {}
    original = interop._tensor

    class Logged:  # records the size of every slice read
        def __init__(self, data, name):
            self.data, self.name, self.shape = data, name, data.shape

        def __getitem__(self, index):
            part = self.data[index]
            reads.setdefault(self.name, []).append(part.size)
            return part

    monkeypatch.setattr(interop, "_tensor", lambda *a: Logged(original(*a), a[-1]))
    zero = zj.zero_shard(stage=3, persistence_threshold=0)
    state = zero.shard(initial_state(TX()))
    state = zero.load_safetensors(state, file, names=hf_name, transpose=stored_transposed)
    for got, ref in zip(
        jax.tree_util.tree_leaves(state.params), jax.tree_util.tree_leaves(want), strict=True
    ):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(ref))
    # never whole: the (64, 256) MLP kernel was read as eight (8, 256) slices
    up = reads[hf_name("block_0/Dense_0/kernel")]
    assert len(up) == 8 and max(up) == 64 * 256 // 8
    assert state.params["block_0"]["Dense_0"]["kernel"].addressable_shards[0].data.shape == (8, 256)

    single = jax.device_put(
        train_state.TrainState.create(apply_fn=MODEL.apply, params=want, tx=TX()), jax.devices()[0]
    )
    ref_losses, losses, step = [], [], zero(train_step)
    for batch in DATA:
        single, m = jax.jit(train_step)(single, batch)
        ref_losses.append(float(m["loss"]))
        state, m = step(state, batch)
        losses.append(float(m["loss"]))
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5, atol=1e-6)


def test_bf16_state_loads_its_fp32_master(hf_file):
    file, want = hf_file
    zero = zj.zero_shard(stage=3, precision="bf16")
    state = zero.shard(initial_state(TX()))
    state = zero.load_safetensors(state, file, names=hf_name, transpose=stored_transposed)
    kernel = want["head"]["kernel"]
    np.testing.assert_array_equal(np.asarray(state.opt_state.master["head"]["kernel"]), kernel)
    assert state.params["head"]["kernel"].dtype == jnp.bfloat16
    np.testing.assert_array_equal(
        np.asarray(state.params["head"]["kernel"]), np.asarray(kernel.astype(jnp.bfloat16))
    )


def test_load_errors_name_the_tensor(hf_file, tmp_path):
    file, _ = hf_file
    zero = zj.zero_shard(stage=3)
    state = zero.shard(initial_state(TX()))
    with pytest.raises(zj.ZeroError, match="no tensor named Embed_0.embedding.*names="):
        zero.load_safetensors(state, file)
    with pytest.raises(zj.ZeroError, match=r"needs \(64, 256\)"):
        zero.load_safetensors(state, file, names=hf_name)  # forgot transpose
    (tmp_path / "bad.safetensors").write_bytes(b"\x01")
    with pytest.raises(zj.ZeroError, match="not a safetensors file"):
        zero.load_safetensors(state, str(tmp_path / "bad.safetensors"))


def test_exported_weights_load_into_a_plain_flax_model_on_one_device(tmp_path):
    from zerojax.io.export import export

    zero = zj.zero_shard(stage=3, precision="bf16")
    state = zero.shard(initial_state(TX()))
    step = zero(train_step)
    for batch in DATA:
        state, _ = step(state, batch)
    with zj.CheckpointManager(tmp_path / "ckpt", zero, async_save=False) as mgr:
        mgr.save(len(DATA), state)
    export(str(tmp_path / "ckpt"), str(tmp_path / "w.msgpack"), dtype="fp32")
    # a plain Flax user: one device, no zerojax
    target = MODEL.init(jax.random.key(1), jnp.zeros((1, CFG.seq_len), jnp.int32))["params"]
    params = serialization.from_bytes(target, (tmp_path / "w.msgpack").read_bytes())
    params = jax.device_put(params, jax.devices()[0])
    logits = MODEL.apply({"params": params}, DATA[0]["inputs"])
    master = jax.device_get(state.opt_state.master)  # the fp32 truth zerojax trained
    np.testing.assert_allclose(
        logits, MODEL.apply({"params": master}, DATA[0]["inputs"]), rtol=1e-6, atol=1e-6
    )
    for got, ref in zip(
        jax.tree_util.tree_leaves(params), jax.tree_util.tree_leaves(master), strict=True
    ):
        np.testing.assert_array_equal(np.asarray(got), ref)
    # ...and the safetensors export loads back into a zerojax state on another layout
    export(str(tmp_path / "ckpt"), str(tmp_path / "w.safetensors"), dtype="fp32")
    other = zj.zero_shard(stage=1, mesh=zj.make_mesh(jax.devices()[:2]))
    again = other.load_safetensors(
        other.shard(initial_state(TX(), 3)), str(tmp_path / "w.safetensors")
    )
    for got, ref in zip(
        jax.tree_util.tree_leaves(again.params), jax.tree_util.tree_leaves(master), strict=True
    ):
        np.testing.assert_array_equal(np.asarray(got), ref)
