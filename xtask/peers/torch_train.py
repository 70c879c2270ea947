"""The PyTorch-eager peer of ironweave-train: the same byte-level MoE GPT (pre-LN attention with a
causal mask, top-k routed experts with capacity, tanh-GELU, load-balancing loss, final LN, head,
AdamW with beta2 0.95) and the same batch, in one process on CPU, timed with the same rule as
`ironweave train` (mean iteration after two warm-up iterations).

Usage: python torch_train.py --config configs/moe-small.toml --iters 8 --threads 2 [--profile]
Prints one JSON object: tokens_per_s, iter_time_s, threads, torch version and, with --profile,
the operators that dominate (self CPU time).
"""
import argparse
import json
import math
import time
import tomllib

import torch
import torch.nn.functional as F


class Block(torch.nn.Module):
    def __init__(self, m, moe):
        super().__init__()
        h, f = m["hidden"], m["hidden"] * m.get("ffn_mult", 4)
        self.heads, self.moe = m["heads"], moe
        self.ln1 = torch.nn.LayerNorm(h, eps=1e-5)
        self.wq, self.wk, self.wv, self.wo = (torch.nn.Linear(h, h, bias=False) for _ in range(4))
        self.ln2 = torch.nn.LayerNorm(h, eps=1e-5)
        if moe:
            self.e, self.k, self.cf = m["experts"], m["top_k"], m["capacity_factor"]
            self.gate = torch.nn.Linear(h, self.e, bias=False)
            self.w1 = torch.nn.Parameter(torch.randn(self.e, h, f) / math.sqrt(h))
            self.w2 = torch.nn.Parameter(torch.randn(self.e, f, h) / math.sqrt(f))
        else:
            self.w1 = torch.nn.Linear(h, f, bias=False)
            self.w2 = torch.nn.Linear(f, h, bias=False)

    def forward(self, x, b, t):
        n, h = x.shape
        nh, hd = self.heads, h // self.heads
        a = self.ln1(x)
        q, k, v = (w(a).view(b, t, nh, hd).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.wo(o.transpose(1, 2).reshape(n, h))
        hn = self.ln2(x)
        if not self.moe:
            return x + self.w2(F.gelu(self.w1(hn), approximate="tanh")), None
        probs = torch.softmax(self.gate(hn), dim=-1)
        top = probs.topk(self.k, dim=-1).indices  # [n, k]
        chose = torch.zeros(n, self.e, dtype=torch.bool).scatter_(1, top, True)
        cap = max(1, math.ceil(self.cf * n * self.k / self.e))
        # first `cap` tokens (in token order) that chose an expert are kept, as in ironweave
        keep = chose & (chose.long().cumsum(0) <= cap)
        out = torch.zeros_like(x)
        for e in range(self.e):
            ids = keep[:, e].nonzero(as_tuple=True)[0]
            if ids.numel() == 0:
                continue
            y = F.gelu(hn[ids] @ self.w1[e], approximate="tanh") @ self.w2[e]
            out = out.index_add(0, ids, y * probs[ids, e : e + 1])
        frac = chose.float().sum(0) / chose.float().sum()
        aux = (probs.mean(0) * frac).sum() * self.e
        return x + out, aux


class Gpt(torch.nn.Module):
    def __init__(self, m):
        super().__init__()
        h = m["hidden"]
        self.tok = torch.nn.Embedding(256, h)
        self.pos = torch.nn.Parameter(torch.randn(m["seq"], h) * 0.02)
        every = m.get("moe_every", 1)
        self.blocks = torch.nn.ModuleList(Block(m, (l + 1) % every == 0) for l in range(m["layers"]))
        self.lnf = torch.nn.LayerNorm(h, eps=1e-5)
        self.head = torch.nn.Linear(h, 256, bias=False)
        self.aux_coef = m.get("aux_loss_coef", 0.01)

    def forward(self, x, y):
        b, t = x.shape
        z = (self.tok(x) + self.pos).reshape(b * t, -1)
        aux = 0.0
        for blk in self.blocks:
            z, a = blk(z, b, t)
            if a is not None:
                aux = aux + a
        return F.cross_entropy(self.head(self.lnf(z)), y.reshape(-1)) + self.aux_coef * aux


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", required=True)
    ap.add_argument("--iters", type=int, default=8)
    ap.add_argument("--threads", type=int, required=True)
    ap.add_argument("--profile", action="store_true")
    a = ap.parse_args()
    if a.iters < 3:
        raise SystemExit("--iters must be at least 3 (two warm-up iterations are not averaged)")
    cfg = tomllib.load(open(a.config, "rb"))
    m, tr = cfg["model"], cfg["train"]
    torch.set_num_threads(a.threads)
    torch.manual_seed(tr["seed"])
    model = Gpt(m)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    other = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": tr.get("weight_decay", 0.0)}, {"params": other, "weight_decay": 0.0}],
        lr=tr["lr"], betas=(0.9, 0.95), eps=1e-8,
    )
    b, t = tr["batch"], m["seq"]
    g = torch.Generator().manual_seed(tr["seed"])
    # the same text as ironweave-train (path relative to the repository root, the working dir)
    text = torch.frombuffer(bytearray(open(cfg["data"]["path"], "rb").read()), dtype=torch.uint8).long()
    times, losses = [], []

    def step():
        starts = torch.randint(0, text.numel() - t - 1, (b,), generator=g)
        x = torch.stack([text[s : s + t + 1] for s in starts.tolist()])
        t0 = time.perf_counter()
        loss = model(x[:, :-1], x[:, 1:])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        times.append(time.perf_counter() - t0)
        losses.append(loss.item())

    for _ in range(a.iters):
        step()
    mean = sum(times[2:]) / len(times[2:])
    out = {
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "iter_time_s": mean,
        "tokens_per_s": b * t / mean,
        "iterations": a.iters,
        "loss_first": losses[0],
        "loss_last": losses[-1],
    }
    if a.profile:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU]) as prof:
            step()
        ev = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
        total = sum(e.self_cpu_time_total for e in ev) or 1
        out["top_ops"] = [
            {"op": e.key, "share": e.self_cpu_time_total / total} for e in ev[:8]
        ]
    print(json.dumps(out))


if __name__ == "__main__":
    main()
