"""The peer contender of bench/peers_speed.py: the same decoder-only LM as zerojax's example
(RMSNorm, causal attention with rotary embeddings, SwiGLU, untied head, no biases) trained with
PyTorch DDP or FSDP2 on CPU (gloo). A benchmark tool only: zerojax never imports it.

    pip install torch==2.13.0
    torchrun --standalone --nproc_per_node 8 bench/torch_lm.py --mode fsdp2 --steps 10

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
    if mode == "ddp":
        return nn.parallel.DistributedDataParallel(model)
    from torch.distributed.fsdp import fully_shard  # FSDP2: each layer, then the root

    for layer in model.layers:
        fully_shard(layer, reshard_after_forward=True)
    return fully_shard(model, reshard_after_forward=True)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--mode", choices=["ddp", "fsdp2"], default="fsdp2")
    for name, default in (("layers", 4), ("d-model", 256), ("heads", 4), ("ffn", 688)):
        p.add_argument(f"--{name}", type=int, default=default)
    for name, default in (("vocab", 256), ("seq", 128), ("batch-per-rank", 8)):
        p.add_argument(f"--{name}", type=int, default=default)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    args = p.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.set_num_threads(1)
    torch.manual_seed(0)  # the same initial weights on every rank
    model = LM(args.vocab, args.d_model, args.layers, args.heads, args.ffn)
    params = sum(x.numel() for x in model.parameters())
    model = wrap(model, args.mode)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    times, losses = [], []
    for step in range(args.warmup + args.steps):
        gen = torch.Generator().manual_seed(1000 * step + rank)
        tokens = torch.randint(0, args.vocab, (args.batch_per_rank, args.seq + 1), generator=gen)
        start = time.perf_counter()
        logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, args.vocab), tokens[:, 1:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
        if step >= args.warmup:
            times.append(time.perf_counter() - start)
    if rank == 0:
        print(
            json.dumps(
                {
                    "mode": args.mode,
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
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
