"""Digests of the lowered steps of the option sweep (every option at every stage, Linen), of an
NNX model's step under the managed and host-update paths, and of local accumulation: an engine
refactor that must not change a program compares them before and after (the module's name,
taken from the jitted Python function's, is left out).

    python bench/lowered_digest.py > before.json
    ... change the engine ...
    python bench/lowered_digest.py --compare before.json   # names every program that changed
"""

import os

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse  # noqa: E402
import hashlib  # noqa: E402
import json  # noqa: E402
import pathlib  # noqa: E402
import re  # noqa: E402
import sys  # noqa: E402
import warnings  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402

import zerojax as zj  # noqa: E402

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "tests"))
from test_option_sweep import BATCH, SAMPLES, init_fn, step  # noqa: E402

NNX_OPTIONS = [  # the NNX paths: plain, managed (16-bit), host update, accumulation
    {"stage": 3},
    {"stage": 3, "precision": "bf16"},
    {"stage": 2, "offload_optimizer": "cpu", "offload_update": "host", "precision": "bf16"},
    {"stage": 1, "gradient_accumulation_steps": 2, "accumulate": "reduced"},
]


class Net(nnx.Module):
    def __init__(self, rngs):
        self.up = nnx.Linear(32, 64, rngs=rngs)
        self.down = nnx.Linear(64, 8, rngs=rngs)

    def __call__(self, x):
        return self.down(nnx.relu(self.up(x)))


def build():
    model = Net(nnx.Rngs(0))
    return model, nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)


def nnx_step(model, optimizer, batch):
    def loss_fn(model):
        return jnp.mean((model(batch["x"]) - batch["y"]) ** 2)

    loss, grads = nnx.value_and_grad(loss_fn)(model)
    optimizer.update(model, grads)
    return loss


def digest(text: str) -> str:
    """The program's hash, less its module's name (`@jit_<the jitted Python function>`)."""
    text = re.sub(r"^module @\S+", "module", text, count=1)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def linen(options: dict) -> str:
    zero = zj.zero_shard(**options)
    state = zero.eval_shape(init_fn, jax.random.key(0))
    return digest(zero(step).lower(state, BATCH).as_text())


def nnx_lowered(options: dict, micro: bool = False) -> str:
    zero = zj.zero_shard(**options)
    model, optimizer = zero.init(build)
    return digest(zero(nnx_step).lower(model, optimizer, BATCH, micro=micro).as_text())


def digests() -> dict:
    out = {}
    for stage in range(4):
        for name, value in [(None, None), *SAMPLES.items()]:
            options = {"stage": stage, **({name: value} if name else {})}
            key = f"linen stage={stage} {name}={value!r}" if name else f"linen stage={stage}"
            try:
                out[key] = linen(options)
            except zj.ZeroError:
                out[key] = "refused"
        out[f"linen stage={stage} accumulation micro"] = digest(
            zj.zero_shard(stage=stage, gradient_accumulation_steps=2)(step)
            .lower(
                zj.zero_shard(stage=stage, gradient_accumulation_steps=2).eval_shape(
                    init_fn, jax.random.key(0)
                ),
                BATCH,
                micro=True,
            )
            .as_text()
        )
    for options in NNX_OPTIONS:
        out[f"nnx {options}"] = nnx_lowered(options)
        if options.get("gradient_accumulation_steps", 1) > 1:
            out[f"nnx {options} micro"] = nnx_lowered(options, micro=True)
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--compare", help="a JSON file an earlier run printed")
    args = parser.parse_args()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        now = digests()
    if not args.compare:
        print(json.dumps(now, indent=1))
        return
    before = json.loads(pathlib.Path(args.compare).read_text())
    changed = sorted(k for k in before.keys() | now.keys() if before.get(k) != now.get(k))
    print(f"{len(now)} programs, {len(changed)} changed")
    for key in changed:
        print(f"  {key}: {before.get(key)} -> {now.get(key)}")
    sys.exit(1 if changed else 0)


if __name__ == "__main__":
    main()
