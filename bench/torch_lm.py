"""The peer contenders of bench/peers_speed.py: the same decoder-only LM as zerojax's example
(RMSNorm, causal attention with rotary embeddings, SwiGLU, untied head, no biases) trained on
CPU by one PyTorch process, PyTorch DDP, FSDP2 (parameters resharded after forward, ZeRO-3-like,
or kept, ZeRO-2-like) or DeepSpeed ZeRO 0-3 (its CPU accelerator, gloo). fp32 AdamW for all.
A benchmark tool only: zerojax never imports it, and torch / deepspeed are never zerojax
dependencies.

    pip install torch==2.13.0
    DS_BUILD_OPS=0 pip install --no-deps deepspeed==0.19.8
    pip install einops hjson msgpack ninja packaging py-cpuinfo 'pydantic>=2' tqdm psutil
    python bench/torch_lm.py --mode single --batch-per-rank 64 --steps 10
    torchrun --standalone --nproc_per_node 8 bench/torch_lm.py --mode fsdp2 --steps 10
    DS_ACCELERATOR=cpu torchrun --standalone --nproc_per_node 8 bench/torch_lm.py \
        --mode deepspeed --zero-stage 3 --steps 10

Batches are random tokens from a generator seeded per (rank, step). Rank 0 prints one JSON line:
params, median/min/max step seconds after --warmup steps, first and last loss.
"""

import argparse
import json
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn


def rope(x: torch.Tensor) -> torch.Tensor:
    """Rotary position embedding of (batch, heads, tokens, head_dim), pairs interleaved."""
    t, d = x.shape[-2:]
    freq = 10000.0 ** (-torch.arange(0, d, 2, dtype=torch.float32) / d)
    angle = torch.arange(t, dtype=torch.float32)[:, None] * freq[None, :]
    even, odd = x[..., 0::2], x[..., 1::2]
    cos, sin = angle.cos(), angle.sin()
    return torch.stack((even * cos - odd * sin, even * sin + odd * cos), -1).flatten(-2)


class Layer(nn.Module):
    def __init__(self, d: int, heads: int, ffn: int):
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.RMSNorm(d), nn.RMSNorm(d)
        self.qkv, self.out = nn.Linear(d, 3 * d, bias=False), nn.Linear(d, d, bias=False)
        self.gate_up = nn.Linear(d, 2 * ffn, bias=False)
        self.down = nn.Linear(ffn, d, bias=False)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(rope(q), rope(k), v, is_causal=True)
        x = x + self.out(y.transpose(1, 2).reshape(b, t, d))
        gate, up = self.gate_up(self.norm2(x)).chunk(2, -1)
        return x + self.down(F.silu(gate) * up)


class LM(nn.Module):
    def __init__(self, vocab: int, d: int, layers: int, heads: int, ffn: int):
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.layers = nn.ModuleList(Layer(d, heads, ffn) for _ in range(layers))
        self.norm, self.head = nn.RMSNorm(d), nn.Linear(d, vocab, bias=False)

    def forward(self, tokens):
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.head(self.norm(x))


def wrap(model: LM, mode: str) -> nn.Module:
    """DDP, or FSDP2 applied as torchtitan does: each layer, then the root. `fsdp2` reshards
    the parameters after forward (gathers them again in backward, ZeRO-3's traffic); `fsdp2-zero2`
    keeps them gathered from forward to backward (ZeRO-2-like memory and traffic)."""
    if mode == "ddp":
        return nn.parallel.DistributedDataParallel(model)
    from torch.distributed.fsdp import fully_shard

    reshard = mode == "fsdp2"
    for layer in model.layers:
        fully_shard(layer, reshard_after_forward=reshard)
    return fully_shard(model, reshard_after_forward=reshard)


def deepspeed_engine(model: LM, stage: int, batch_per_rank: int):
    """DeepSpeed's engine at ZeRO `stage` over torch's AdamW (fp32; DeepSpeed's own fused Adam
    needs compiled ops, which a CPU benchmark install does not build)."""
    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo")
    config = {
        "train_micro_batch_size_per_gpu": batch_per_rank,
        "gradient_accumulation_steps": 1,
        "zero_optimization": {"stage": stage},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10**9,
    }
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=config)
    return engine


def step_fn(mode: str, model: LM, batch_per_rank: int, zero_stage: int):
    """One training step of `mode` as a function of the tokens; returns the loss."""
    if mode == "deepspeed":
        engine = deepspeed_engine(model, zero_stage, batch_per_rank)

        def ds_step(tokens):
            loss = lm_loss(engine, tokens)
            engine.backward(loss)
            engine.step()
            return loss

        return ds_step
    if mode != "single":
        model = wrap(model, mode)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def torch_step(tokens):
        loss = lm_loss(model, tokens)
        opt.zero_grad()
        loss.backward()
        opt.step()
        return loss

    return torch_step


def lm_loss(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    logits = model(tokens[:, :-1])
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument(
        "--mode", choices=["single", "ddp", "fsdp2", "fsdp2-zero2", "deepspeed"], default="fsdp2"
    )
    p.add_argument("--zero-stage", type=int, choices=range(4), help="DeepSpeed's ZeRO stage")
    p.add_argument(
        "--threads",
        type=int,
        default=0,
        help="intra-op threads (0: 1 per rank, torch's default for --mode single)",
    )
    for name, default in (("layers", 4), ("d-model", 256), ("heads", 4), ("ffn", 688)):
        p.add_argument(f"--{name}", type=int, default=default)
    for name, default in (("vocab", 256), ("seq", 128), ("batch-per-rank", 8)):
        p.add_argument(f"--{name}", type=int, default=default)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    args = p.parse_args()
    if (args.zero_stage is None) == (args.mode == "deepspeed"):
        p.error("--zero-stage is required with --mode deepspeed and taken by no other mode")
    single = args.mode == "single"
    if not single and args.mode != "deepspeed":
        dist.init_process_group("gloo")
    if args.threads or not single:
        torch.set_num_threads(args.threads or 1)
    torch.manual_seed(0)  # the same initial weights on every rank
    model = LM(args.vocab, args.d_model, args.layers, args.heads, args.ffn)
    params = sum(x.numel() for x in model.parameters())
    step = step_fn(args.mode, model, args.batch_per_rank, args.zero_stage)
    rank = 0 if single else dist.get_rank()
    times, losses = [], []
    for i in range(args.warmup + args.steps):
        gen = torch.Generator().manual_seed(1000 * i + rank)
        tokens = torch.randint(0, args.vocab, (args.batch_per_rank, args.seq + 1), generator=gen)
        start = time.perf_counter()
        loss = step(tokens)
        losses.append(loss.item())
        if i >= args.warmup:
            times.append(time.perf_counter() - start)
    if rank == 0:
        print(
            json.dumps(
                {
                    "mode": args.mode,
                    "zero_stage": args.zero_stage,
                    "threads": torch.get_num_threads(),
                    "params": params,
                    "step_s_median": statistics.median(times),
                    "step_s_min": min(times),
                    "step_s_max": max(times),
                    "first_loss": losses[0],
                    "last_loss": losses[-1],
                }
            ),
            flush=True,
        )
    if not single:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
