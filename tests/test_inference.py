"""Evaluation and greedy decoding from a stage-3 state, as docs/inference.md writes them: the
parameters gathered once onto every device, or plain `jax.jit` on the shards. Both give the
tokens one device gives from the same parameters. A model written here, as a user would."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax.training.train_state import TrainState
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import zerojax as zj

VOCAB, SEQ = 64, 16


class TinyLM(nn.Module):
    @nn.compact
    def __call__(self, tokens):
        x = nn.Embed(VOCAB, 64)(tokens)
        for _ in range(2):
            x = x + nn.Dense(64)(nn.gelu(nn.Dense(256)(nn.LayerNorm()(x))))
        return nn.Dense(VOCAB)(nn.LayerNorm()(x))


MODEL = TinyLM()


def init_fn(key):
    params = MODEL.init(key, jnp.zeros((1, SEQ), jnp.int32))["params"]
    return TrainState.create(apply_fn=MODEL.apply, params=params, tx=optax.adam(1e-2))


def train_step(state, batch):
    def loss_fn(params):
        logits = state.apply_fn({"params": params}, batch[:, :-1])
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch[:, 1:]).mean()

    loss, grads = jax.value_and_grad(loss_fn)(state.params)
    return state.apply_gradients(grads=grads), loss


# the recipe of docs/inference.md, as written there
@jax.jit
def greedy(params, prompt, length):
    """`prompt` [batch, SEQ] with `length` tokens given: the rest filled greedily."""

    def next_token(position, tokens):
        logits = MODEL.apply({"params": params}, tokens)[:, position - 1]
        return tokens.at[:, position].set(jnp.argmax(logits, axis=-1).astype(tokens.dtype))

    return jax.lax.fori_loop(length, SEQ, next_token, prompt)


def test_greedy_decoding_from_a_stage_3_state_equals_one_device():
    zero = zj.zero_shard(stage=3)
    state = zero.init(init_fn, jax.random.key(0))
    step = zero(train_step)
    rng = np.random.default_rng(0)
    for _ in range(5):  # learn a little: a counting sequence
        start = rng.integers(0, VOCAB, (16, 1))
        state, _ = step(state, ((start + np.arange(SEQ + 1)) % VOCAB).astype(np.int32))
    prompt = np.zeros((8, SEQ), np.int32)
    prompt[:, :4] = (np.arange(8)[:, None] + np.arange(4)) % VOCAB

    host = jax.tree.map(np.asarray, state.params)  # one device's reference
    with jax.default_device(jax.devices()[0]):
        want = np.asarray(greedy(jax.device_put(host, jax.devices()[0]), prompt, 4))

    whole = jax.device_put(state.params, NamedSharding(zero.mesh, P()))  # gather once
    np.testing.assert_array_equal(np.asarray(greedy(whole, prompt, 4)), want)
    on_shards = greedy(state.params, prompt, 4)  # jax.jit on the shards: XLA gathers
    np.testing.assert_array_equal(np.asarray(on_shards), want)
    assert (want[:, 4:] != 0).any()  # it decoded something
    # the stage-3 state itself is untouched: still split
    kernel = state.params["Dense_0"]["kernel"]
    assert kernel.addressable_shards[0].data.size == kernel.size // 8
