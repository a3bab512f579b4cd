"""`keep_gathered` and `memory_budget` on the transformer of tests/test_units.py (written as a
user writes one): units kept gathered from forward to backward save their backward all-gather
and train exactly like one device; a budget chooses them from compiled peaks."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import zerojax as zj
from tests.common import assert_trees_close, in_run_dtype
from tests.test_units import Transformer, init_fn, step, train_both
from zerojax.engine.budget import largest_fitting

SEQ = 16
DATA = [np.random.default_rng(i).integers(0, 128, (16, SEQ + 1), dtype=np.int32) for i in range(2)]


def start(model):
    return jax.device_put(in_run_dtype(init_fn(model, SEQ)(jax.random.key(0))), jax.devices()[0])


def report(zero, model, as_trained=False):
    """The compiled step's report, for the state as `start` trains it (float64) or as
    `init_fn` makes it (float32, whose bytes the tests below count)."""

    def init(key):
        state = init_fn(model, SEQ)(key)
        return in_run_dtype(state) if as_trained else state

    state = zero.eval_shape(init, jax.random.key(0))
    return zero.report(zero(step), state, DATA[0])


@pytest.mark.parametrize("scan, keep", [(False, r"block_[01]"), (True, "blocks")])
def test_units_kept_gathered_send_less_and_match_single_device(scan, keep):
    model = Transformer(4, scan)
    zero = zj.zero_shard(stage=3, keep_gathered=keep)
    with jax.enable_x64(True):  # exact: float64 (tests/common.py, "Parity")
        got, want, _ = train_both(zero, step, start(model), DATA)
        assert_trees_close(got.params, want.params)
    plain, kept = report(zj.zero_shard(stage=3), model), report(zero, model)
    # each kept unit's weights are gathered once, not twice: the all-gather bytes drop by the
    # kept units' share (2 of 4 blocks unrolled: a quarter; the whole stack scanned: a half)
    drop = 1 - kept.bytes_of("all-gather") / plain.bytes_of("all-gather")
    assert drop == pytest.approx(0.25 if not scan else 0.5, abs=0.03), drop
    assert kept.peak_bytes > plain.peak_bytes  # paid for in memory


@pytest.mark.usefixtures("x64")  # exact: float64 (tests/common.py, "Parity")
def test_a_budget_above_the_minimum_keeps_units_and_stays_under_it():
    model = Transformer(4, False)
    minimum = report(zj.zero_shard(stage=3), model, as_trained=True).peak_bytes
    budget = int(1.7 * minimum)
    zero = zj.zero_shard(stage=3, memory_budget=budget)
    got, want, fitted = train_both(zero, step, start(model), DATA)
    assert_trees_close(got.params, want.params)
    choice = fitted.budget
    assert choice.minimal_peak_bytes == minimum and choice.kept  # it spent the memory...
    assert choice.peak_bytes <= budget  # ...within the budget...
    assert choice.sent_bytes < choice.plain_sent_bytes  # ...on fewer bytes sent per step
    assert "kept gathered: block_" in str(choice)


def test_a_budget_below_the_minimum_names_the_minimum():
    model = Transformer(4, False)
    minimum = report(zj.zero_shard(stage=3), model, as_trained=True).peak_bytes
    zero = zj.zero_shard(stage=3, memory_budget=minimum - 1)
    with pytest.raises(zj.ZeroError, match=f"compiled peak of .*\\({minimum:,} bytes\\)"):
        zero(step)(zero.shard(start(model)), DATA[0])


@pytest.mark.parametrize(
    "options, message",
    [
        (dict(memory_budget="70 gigs"), "memory_budget: '70 gigs' is not a size"),
        (dict(memory_budget=-1), "memory_budget must be a size"),
        (dict(memory_budget=1.5), "fraction of the device's memory in \\(0, 1\\]"),
        (dict(keep_gathered="block_("), "keep_gathered regex 'block_\\(' does not compile"),
    ],
)
def test_bad_budget_options_name_the_option(options, message):
    with pytest.raises(zj.ZeroError, match=message):
        zj.zero_shard(stage=3, **options)


def test_a_fraction_needs_a_device_that_reports_its_memory():
    zero = zj.zero_shard(stage=3, memory_budget=0.9)
    with pytest.raises(zj.ZeroError, match="cpu devices do not report: give a size"):
        zero(step)(zero.shard(start(Transformer(2, False))), jnp.asarray(DATA[0]))


@pytest.mark.parametrize(
    "peak",
    [
        lambda b: 100 + 10 * b,  # affine: activations per sequence
        lambda b: 100 + 10 * b + b * b // 50,  # convex
        lambda b: 100 + 64 * ((10 * b + 63) // 64),  # XLA's buffers in steps
        lambda b: 10**9,  # nothing fits
    ],
    ids=["affine", "convex", "steps", "none"],
)
def test_largest_fitting_batch_matches_a_search_of_every_batch(peak):
    for limit in (105, 1000, 5000):
        want = max([b for b in range(1, 2000) if peak(b) <= limit], default=0)
        got, compiles = largest_fitting(peak, limit)
        assert got == want and compiles <= 16
