"""Pretrain the example decoder LM with zerojax, on simulated CPU devices or real accelerators.

    python examples/pretrain_lm.py                                   # tiny, 8 CPU devices, stage 3
    python examples/pretrain_lm.py --config configs/zero3_bf16.json --preset small --steps 1000
    zerojax launch -n 2 --devices-per-process 4 -- python examples/pretrain_lm.py

The train step below is the plain single-device Flax step: zerojax wraps it unchanged. Data
defaults to the Python standard library's own source as bytes (on every machine); `--data`
takes text files / globs or one uint16 token file. Checkpoints (`--ckpt-dir`) resume
automatically; metrics go to LOG_DIR/metrics.jsonl (and TensorBoard, and a PNG plot, when
`pip install zerojax[examples]` brought tensorboardX and matplotlib).
"""

import argparse
import json
import os
import sys
import time


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--preset", default="tiny", help="tiny, small, 125m, 350m, 1.3b, 7b")
    p.add_argument("--config", help="DeepSpeed-style JSON (e.g. configs/zero3.json)")
    p.add_argument("--stage", type=int, help="overrides the config's stage (default 3)")
    p.add_argument("--precision", choices=["fp32", "bf16", "fp16"], help="overrides the config")
    p.add_argument(
        "--optimizer-state-dtype", choices=["fp32", "bf16"], help="Adam moments' dtype at rest"
    )
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--batch-size", type=int, default=32, help="global sequences per step")
    p.add_argument("--seq-len", type=int, help="default: the preset's")
    p.add_argument("--lr", type=float, default=3e-3, help="peak; linear warmup then cosine")
    p.add_argument("--warmup", type=int, default=30)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--eval-every", type=int, default=50)
    p.add_argument("--eval-batches", type=int, default=4)
    p.add_argument("--log-dir", default="runs/pretrain_lm")
    p.add_argument(
        "--ckpt-dir",
        help="save here every --save-every steps and resume from it (default: LOG_DIR/ckpt; "
        "'none': no checkpoints)",
    )
    p.add_argument("--save-every", type=int, default=50)
    p.add_argument("--data", help="text files / globs, or one uint16 .bin/.npy token file")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--devices", type=int, default=8, help="simulated CPU devices (CPU only)")
    p.add_argument("--peak-tflops", type=float, help="per-device peak for MFU")
    p.add_argument("--sample-len", type=int, default=200)
    p.add_argument("--no-progress", action="store_true", help="a line per 10 steps, no bar")
    p.add_argument("--coordinator", help="multi-node: host:port of process 0")
    p.add_argument("--num-processes", type=int)
    p.add_argument("--process-id", type=int)
    p.add_argument("--cluster", action="store_true", help="jax.distributed auto-detection")
    args = p.parse_args(argv)
    if args.ckpt_dir is None:  # checkpoints by default, beside the logs
        args.ckpt_dir = os.path.join(args.log_dir, "ckpt")
    elif args.ckpt_dir.lower() == "none":
        args.ckpt_dir = None
    return args


def learning_rate(state, position: int, schedule) -> float:
    """The learning rate of the update just made: the optimizer state's injected one (a
    config's optimizer), else the example's own schedule at `position`."""
    has = lambda x: hasattr(x, "hyperparams")
    injected = [x for x in jax.tree_util.tree_leaves(state.opt_state, is_leaf=has) if has(x)]
    return float(injected[0].hyperparams["learning_rate"] if injected else schedule(position))


def train_step(state, tokens):
    """The plain Flax step: next-token cross-entropy, value_and_grad, apply_gradients."""

    def loss_fn(params):
        logits = state.apply_fn({"params": params}, tokens[:, :-1])
        return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()

    loss, grads = jax.value_and_grad(loss_fn)(state.params)
    return state.apply_gradients(grads=grads), {"loss": loss}


PEAK_BF16_TFLOPS = {
    "H200": 989,
    "H100": 989,
    "A100": 312,
    "L4": 121,
    "TPU v4": 275,
    "TPU v5 lite": 197,
    "TPU v5e": 197,
    "TPU v5p": 459,
}


def flops_per_token(cfg, params: int) -> float:
    """6 x non-embedding parameters + the attention term 12 x layers x d_model x seq_len."""
    return 6 * (params - cfg.vocab * cfg.d_model) + 12 * cfg.n_layers * cfg.d_model * cfg.seq_len


def peak_flops(args) -> float | None:
    if args.peak_tflops:
        return args.peak_tflops * 1e12
    kind = jax.devices()[0].device_kind
    return next((v * 1e12 for k, v in PEAK_BF16_TFLOPS.items() if k in kind), None)


class Logger:
    """metrics.jsonl always; TensorBoard events and a PNG plot when their packages exist."""

    def __init__(self, log_dir: str, main: bool, resumed: bool):
        self.main, self.log_dir, self.records = main, log_dir, []
        self.tb = None
        if not main:
            return
        os.makedirs(log_dir, exist_ok=True)
        # a resumed run continues the records; a new one starts them again
        self.jsonl = open(os.path.join(log_dir, "metrics.jsonl"), "a" if resumed else "w")
        try:
            from tensorboardX import SummaryWriter

            self.tb = SummaryWriter(log_dir)
        except ImportError:
            print(
                "(tensorboardX not installed: no TensorBoard files; pip install "
                "'zerojax[examples]')"
            )

    def log(self, record: dict):
        self.records.append(record)
        if not self.main:
            return
        self.jsonl.write(json.dumps(record) + "\n")
        self.jsonl.flush()
        if self.tb is not None:
            for k, v in record.items():
                if k != "step" and isinstance(v, (int, float)):
                    self.tb.add_scalar(k, v, record["step"])

    def close(self):
        if not self.main:
            return
        self.jsonl.close()
        if self.tb is not None:
            self.tb.close()
        try:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError:
            print("(matplotlib not installed: no loss plot; pip install 'zerojax[examples]')")
            return
        fig, ax = plt.subplots(figsize=(7, 4))
        for key in ("loss", "eval_loss"):
            pts = [(r["step"], r[key]) for r in self.records if key in r]
            if pts:
                ax.plot(
                    *zip(*pts, strict=True), label=key, marker="o" if key == "eval_loss" else None
                )
        ax.set_xlabel("step")
        ax.set_ylabel("nats / byte")
        ax.legend()
        fig.savefig(os.path.join(self.log_dir, "loss.png"), dpi=100)
        print(f"plot: {os.path.join(self.log_dir, 'loss.png')}")


def evaluate(eval_loss, state, zero, batches) -> float:
    params = jax.tree_util.tree_map(  # offloaded parameters come to the device
        lambda x: jax.device_put(x, x.sharding.with_memory_kind("device")), state.params
    )
    return float(sum(eval_loss(params, zero.place_batch(b)) for b in batches) / len(batches))


def sample(model, params, prompt: bytes, length: int, seq_len: int, seed: int) -> str:
    """Temperature-0.8 sampling from the trained model, one byte at a time (no KV cache)."""
    params = jax.device_put(params, jax.local_devices()[0])
    logits_at = jax.jit(lambda p, t, i: model.apply({"params": p}, t)[0, i])
    tokens = np.zeros((1, seq_len), np.int32)
    out, key = list(prompt), jax.random.key(seed)
    for _ in range(length):
        window = out[-seq_len:]
        tokens[0, : len(window)] = window
        key, sub = jax.random.split(key)
        logits = logits_at(params, tokens, len(window) - 1)
        out.append(int(jax.random.categorical(sub, logits / 0.8)))
    return bytes(out).decode("utf-8", errors="replace")


def main(argv=None):
    args = parse(argv)
    if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = (
            os.environ.get("XLA_FLAGS", "")
            + f" --xla_force_host_platform_device_count={args.devices}"
        )
    global jax, np, optax
    import jax
    import numpy as np
    import optax
    from jax.experimental import multihost_utils

    import zerojax as zj
    from zerojax import initialize
    from zerojax.core.config_files import read_config
    from zerojax.models.data import Batches, load_tokens
    from zerojax.models.gpt import make_init
    from zerojax.models.lm import LM, LM_PRESETS

    initialize(args.coordinator, args.num_processes, args.process_id, cluster=args.cluster)
    main_process, n_proc = jax.process_index() == 0, jax.process_count()
    say = print if main_process else (lambda *a, **k: None)

    cfg = LM_PRESETS[args.preset].replace(**({"seq_len": args.seq_len} if args.seq_len else {}))
    overrides = {
        k: v
        for k, v in (
            ("stage", args.stage),
            ("precision", args.precision),
            ("optimizer_state_dtype", args.optimizer_state_dtype),
        )
        if v is not None
    }
    if args.config is None:
        overrides.setdefault("stage", 3)
    zero = zj.zero_shard(config=args.config, **overrides)
    schedule = optax.warmup_cosine_decay_schedule(
        0.0, args.lr, args.warmup, max(args.steps, args.warmup + 1), args.lr * 0.1
    )
    tx = optax.adamw(schedule, b1=0.9, b2=0.95, weight_decay=args.weight_decay)
    described = "adamw, lr {args.lr} (warmup {args.warmup}, cosine)"
    if args.config and "optimizer" in read_config(args.config):
        # the config's optimizer and scheduler; its "auto" values from these flags, as the
        # Hugging Face Trainer fills them from its arguments
        tx = zj.optimizer_from_config(
            args.config,
            lr=args.lr,
            betas=(0.9, 0.95),
            weight_decay=args.weight_decay,
            warmup_num_steps=args.warmup,
            total_num_steps=args.steps,
        )
        described = "the config's optimizer and scheduler blocks"
    model = LM(cfg)
    init_fn = make_init(model, tx)
    tokens, source = load_tokens(args.data)
    batches = Batches(tokens, cfg.seq_len, args.batch_size, args.seed)
    if args.batch_size % (n_proc * zero.axis_size // n_proc):
        raise SystemExit(
            f"--batch-size {args.batch_size} does not divide over {zero.axis_size} devices."
        )
    local = args.batch_size // n_proc
    rows = slice(jax.process_index() * local, (jax.process_index() + 1) * local)

    key, start = jax.random.key(args.seed), 0
    ckpt = None
    if args.ckpt_dir:
        ckpt = zj.CheckpointManager(
            args.ckpt_dir,
            zero,
            save_interval_steps=args.save_every,
            max_to_keep=3,
            save_on_preemption=True,
        )
    if ckpt is not None and ckpt.latest_step() is not None:
        state, extra = ckpt.restore(jax.eval_shape(init_fn, key))
        start = extra["data_position"]
        say(f"resumed from {args.ckpt_dir} at step {start}")
        for path in ckpt.cleanup():  # newer steps that did not restore would block new saves
            say(f"moved aside {path} (it does not restore; nothing was deleted)")
    else:
        state = zero.init(init_fn, key)
    step = zero(train_step)
    params = sum(x.size for x in jax.tree_util.tree_leaves(state.params))

    report = zero.report(
        step, state, jax.ShapeDtypeStruct((args.batch_size, cfg.seq_len + 1), np.int32)
    )
    mib = lambda b: f"{b / 2**20:,.1f} MiB"
    say(
        f"zerojax pretrain_lm: preset {args.preset} ({params:,} parameters, {cfg.n_layers} "
        f"layers, seq {cfg.seq_len}), data: {source}\n"
        f"  {zero!r} on {jax.device_count()} {jax.devices()[0].platform} devices in {n_proc} "
        f"process(es); precision {zero.config.precision}, offload optimizer "
        f"{zero.config.offload_optimizer} / param {zero.config.offload_param}, optimizer "
        f"state {zero.config.optimizer_state_dtype}\n"
        f"  per device: state at rest {mib(sum(report.resident.values()))}, host "
        f"{mib(sum(report.host_resident.values()))}, compiled peak {mib(report.peak_bytes)}; "
        f"communication {mib(report.sent_bytes)} sent per step"
        + (f" ({mib(report.cross_node_bytes)} across nodes)" if "node" in zero.mesh.shape else "")
        + "\n"
        f"  {args.steps} steps of {args.batch_size} x {cfg.seq_len} tokens, optimizer "
        f"{described.format(args=args)}, log {args.log_dir}"
    )

    logger = Logger(args.log_dir, main_process, resumed=start > 0)
    eval_loss = jax.jit(
        lambda p, t: optax.softmax_cross_entropy_with_integer_labels(
            model.apply({"params": p}, t[:, :-1]), t[:, 1:]
        ).mean()
    )
    held_out = batches.eval_batches(args.eval_batches, rows)
    peak, fpt = peak_flops(args), flops_per_token(cfg, params)
    bar = None
    if main_process and not args.no_progress:
        try:
            from tqdm import tqdm

            bar = tqdm(total=args.steps, initial=start, dynamic_ncols=True)
        except ImportError:
            pass
    t_start, tokens_done = time.perf_counter(), 0
    for position in range(start, args.steps):
        t0 = time.perf_counter()
        state, metrics = step(state, batches.train_batch(position, rows))
        loss = float(metrics["loss"])
        dt = time.perf_counter() - t0
        tps = args.batch_size * cfg.seq_len / dt
        tokens_done += args.batch_size * cfg.seq_len
        mfu = fpt * tps / (peak * jax.device_count()) if peak else None
        stats = jax.local_devices()[0].memory_stats() or {}
        record = {
            "step": position + 1,
            "loss": loss,
            "lr": learning_rate(state, position, schedule),
            "tokens_per_s": tps,
            **({"mfu": mfu} if mfu is not None else {}),
        }
        logger.log(record)
        shown = (
            f"loss {loss:.3f} | {tps:,.0f} tok/s | MFU "
            f"{'n/a' if mfu is None else f'{100 * mfu:.1f}%'} | mem "
            f"{mib(stats['bytes_in_use']) if 'bytes_in_use' in stats else 'n/a'}"
        )
        if bar is not None:
            bar.set_description(shown, refresh=False)
            bar.update(1)
        elif (position + 1) % 10 == 0:
            say(f"step {position + 1:>6} | {shown}", flush=True)
        last = position + 1 == args.steps
        if args.eval_every and ((position + 1) % args.eval_every == 0 or last):
            ev = evaluate(eval_loss, state, zero, held_out)
            logger.log({"step": position + 1, "eval_loss": ev})
            (bar.write if bar is not None else say)(f"step {position + 1}: eval loss {ev:.3f}")
        if ckpt is not None:
            ckpt.save(position + 1, state, extra={"data_position": position + 1})
            if ckpt.preempted:
                say(f"SIGTERM: saved step {position + 1}, stopping")
                break
    if bar is not None:
        bar.close()
    if ckpt is not None:
        ckpt.close()
    elapsed = time.perf_counter() - t_start
    logger.close()
    say(
        f"done: {tokens_done:,} tokens in {elapsed:.1f} s "
        f"({tokens_done / max(elapsed, 1e-9):,.0f} tok/s)"
    )
    if args.sample_len and params * 4 < 2**30:
        full = multihost_utils.process_allgather(
            jax.tree_util.tree_map(
                lambda x: jax.device_put(x, x.sharding.with_memory_kind("device")), state.params
            ),
            tiled=True,
        )
        say("sample:\n" + sample(model, full, b"def ", args.sample_len, cfg.seq_len, args.seed))
    if n_proc > 1:
        jax.distributed.shutdown()


if __name__ == "__main__":
    sys.exit(main())
