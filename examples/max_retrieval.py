#!/usr/bin/env python
"""Max retrieval out of distribution: softmax, adaptive temperature, and SSA attention.

The task of "Softmax is not Enough (for sharp out-of-distribution)" (Velickovic et al., 2025,
appendix A), rebuilt from the paper's description:

* a set of items, each with a priority ``p ~ U(0, 1)`` and one of 10 classes; the answer is the
  class of the item with the highest priority;
* an MLP encodes each item (its priority and one-hot class); a single attention head, whose query
  is a learned vector, attends over the items; an MLP decodes the attended value into 10 logits;
* trained with cross-entropy on sets of 5 to 16 items;
* tested on sets of 16, 32, ..., 16384 items (the same sets for every variant, fixed seeds):
  - ``softmax``: the softmax-trained model as trained (``ssa_flash.softmax_attention``);
  - ``adaptive``: the same model with the entropy-driven adaptive temperature applied at
    inference only (``ssa_flash.adaptive_temperature_attention``);
  - ``ssa``: a second model trained and tested with SSA attention (``ssa_flash.ssa_attention``,
    learnable ``b > 0``, ``n >= 1`` initialised to 1 and 1.5);
  - ``ssa_adaptive``: the SSA model with adaptive temperature applied at inference (an extra).

The paper's Table 1: 98.6% at 16 items; at 16384 items 12.4% with softmax, 14.0% with adaptive
temperature (chance is 10%).

    python examples/max_retrieval.py --quick        # CPU smoke test, < 2 minutes
    python examples/max_retrieval.py                # full mode, meant for one GPU (~10 min, estimate)
    python examples/max_retrieval.py --preset cpu   # the scaled-down CPU run of docs/reproduction.md

Writes ``<out>/max_retrieval.json`` (results table + provenance) and PNG plots when matplotlib is present.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

try:
    import ssa_flash
except ImportError:  # running from a checkout without installing the package
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    import ssa_flash

from run_info import default_out_dir, device_name, provenance, resolved_backend  # noqa: E402 (after the path fix)
from ssa_flash.temperature import DEFAULT_POLY, DEFAULT_THRESHOLD, beta_from_entropy

HERE = os.path.dirname(os.path.abspath(__file__))
CLASSES = 10
TRAIN_SIZES = (5, 16)
TEST_SIZES = [2 ** i for i in range(4, 15)]  # 16 .. 16384
VARIANTS = ("softmax", "adaptive", "ssa", "ssa_adaptive")
BASE = {"adaptive": "softmax", "ssa_adaptive": "ssa"}  # the same model without adaptive temperature
PAPER = {
    "source": "Velickovic et al. 2025, 'Softmax is not Enough', Table 1, as quoted in the ssa_flash issue",
    "accuracy": {"softmax": {"16": 0.986, "16384": 0.124}, "adaptive": {"16": 0.986, "16384": 0.140}},
}

PRESETS = {
    # fewest steps that still exercise everything (tests/examples/test_examples.py)
    "smoke": dict(dim=16, steps=40, batch=32, lr=3e-3, eval_sets=16, max_test=1024),
    # CI smoke test: < 2 minutes on a 2-core CPU
    "quick": dict(dim=32, steps=600, batch=64, lr=3e-3, eval_sets=100, max_test=16384),
    # the scaled-down CPU run reported in docs/reproduction.md
    "cpu": dict(dim=64, steps=4000, batch=64, lr=2e-3, eval_sets=1000, max_test=16384),
    # one GPU, ~10 minutes for both models (estimate, not measured)
    "full": dict(dim=128, steps=50000, batch=128, lr=1e-3, eval_sets=4096, max_test=16384),
}


# ---------------------------------------------------------------------------------------------
# Model


def inverse_softplus(y: float) -> float:
    return math.log(math.expm1(y))


def mlp(d_in, dim, d_out):
    return nn.Sequential(nn.Linear(d_in, dim), nn.GELU(), nn.Linear(dim, dim), nn.GELU(), nn.Linear(dim, d_out))


class MaxRetriever(nn.Module):
    """Item MLP encoder -> one attention head (learned query) -> MLP decoder."""

    def __init__(self, dim: int, kind: str, backend: str):
        super().__init__()
        self.kind, self.backend = kind, backend
        self.encoder = mlp(1 + CLASSES, dim, dim)
        self.query = nn.Parameter(torch.randn(dim) / math.sqrt(dim))
        self.wq, self.wk, self.wv = nn.Linear(dim, dim), nn.Linear(dim, dim), nn.Linear(dim, dim)
        self.decoder = mlp(dim, dim, CLASSES)
        if kind == "ssa":  # one head: b = softplus(b_raw) > 0, n = 1 + softplus(n_raw) >= 1
            self.b_raw = nn.Parameter(torch.full((1,), inverse_softplus(1.0)))
            self.n_raw = nn.Parameter(torch.full((1,), inverse_softplus(0.5)))

    def b(self):
        return F.softplus(self.b_raw)

    def n(self):
        return 1.0 + F.softplus(self.n_raw)

    def qkv(self, prio, cls):
        """q (B,1,1,d), k and v (B,1,N,d) for priorities (B,N) and classes (B,N)."""
        x = torch.cat([prio.unsqueeze(-1), F.one_hot(cls, CLASSES).to(prio.dtype)], dim=-1)
        h = self.encoder(x)
        q = self.wq(self.query).expand(prio.shape[0], 1, 1, -1)
        return q, self.wk(h).unsqueeze(1), self.wv(h).unsqueeze(1)

    def attend(self, q, k, v, adaptive=False, return_lse=False):
        kw = dict(backend=self.backend, return_lse=return_lse)
        if self.kind == "ssa":
            return ssa_flash.ssa_attention(q, k, v, b=self.b(), n=self.n(), adaptive_temperature=adaptive, **kw)
        if adaptive:
            return ssa_flash.adaptive_temperature_attention(q, k, v, **kw)
        return ssa_flash.softmax_attention(q, k, v, **kw)

    def forward(self, prio, cls, adaptive=False):
        q, k, v = self.qkv(prio, cls)
        return self.decoder(self.attend(q, k, v, adaptive)[:, 0, 0])


# ---------------------------------------------------------------------------------------------
# Data


def make_sets(gen: torch.Generator, batch: int, size: int):
    """Priorities (batch, size) ~ U(0,1), classes (batch, size), target = class of the max priority.
    Drawn on the CPU from ``gen``: a seed gives the same sets on every device."""
    prio = torch.rand(batch, size, generator=gen)
    cls = torch.randint(0, CLASSES, (batch, size), generator=gen)
    target = cls.gather(1, prio.argmax(1, keepdim=True)).squeeze(1)
    return prio, cls, target


# ---------------------------------------------------------------------------------------------
# Train / evaluate


def train(kind, cfg, device, log_every):
    torch.manual_seed(cfg["seed"])  # same initial weights for both kinds (b, n are constants)
    model = MaxRetriever(cfg["dim"], kind, cfg["backend"]).to(device)
    opt = torch.optim.Adam(model.parameters(), lr=cfg["lr"])
    steps, warmup = cfg["steps"], max(1, cfg["steps"] // 50)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warmup) * (0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * min(s, steps) / steps))))
    gen = torch.Generator().manual_seed(cfg["data_seed"])  # same batches for both kinds
    curve, t0, run_loss, run_acc, skipped = [], time.time(), 0.0, 0.0, 0
    model.train()
    for step in range(steps):
        size = int(torch.randint(TRAIN_SIZES[0], TRAIN_SIZES[1] + 1, (1,), generator=gen))
        prio, cls, target = (t.to(device) for t in make_sets(gen, cfg["batch"], size))
        logits = model(prio, cls)
        loss = F.cross_entropy(logits, target)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        # A step whose gradients are not finite is skipped (as AMP's GradScaler does) and counted:
        # ssa_flash's reference backend (the CPU path) can return NaN gradients when b*|z| == 1
        # exactly (see docs/reproduction.md); the fused kernels do not.
        if bool(torch.stack([p.grad.isfinite().all() for p in model.parameters() if p.grad is not None]).all()):
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
        else:
            skipped += 1
        sched.step()
        run_loss += loss.item()
        run_acc += (logits.argmax(-1) == target).float().mean().item()
        if (step + 1) % log_every == 0 or step + 1 == steps:
            m = (step % log_every) + 1
            curve.append({"step": step + 1, "loss": run_loss / m, "acc": run_acc / m})
            print(f"  [{kind:7s}] step {step + 1:6d}/{steps}  loss {run_loss / m:.4f}  acc {run_acc / m:.3f}  "
                  f"({time.time() - t0:.0f}s)", flush=True)
            run_loss = run_acc = 0.0
    if device.type == "cuda":
        torch.cuda.synchronize()
    return model, curve, time.time() - t0, skipped


@torch.no_grad()
def evaluate(model, size, cfg, device, variants):
    """Accuracy, mean attention weight on the max-priority item and mean attention entropy for
    ``eval_sets`` sets of ``size`` items drawn from a seed that depends only on (eval_seed, size)."""
    model.eval()
    gen = torch.Generator().manual_seed(cfg["eval_seed"] * 100003 + size)
    chunk = max(1, min(cfg["eval_sets"], (1 << 20) // size))  # about 1M items per chunk
    stats = {v: {"correct": 0, "weight_on_max": 0.0, "entropy": 0.0} for v in variants}
    hits = {v: [] for v in variants}  # per-set correctness, for paired comparisons
    left = cfg["eval_sets"]
    while left > 0:
        m = min(chunk, left)
        prio, cls, target = (t.to(device) for t in make_sets(gen, m, size))
        q, k, v = model.qkv(prio, cls)
        k_max = k[torch.arange(m, device=device), 0, prio.argmax(1)].unsqueeze(1).unsqueeze(1)  # (m,1,1,d)
        scale = 1.0 / math.sqrt(q.shape[-1])
        z_max = (scale * (q * k_max).sum(-1)).float()  # logit of the max item, (m,1,1)
        ssa = model.kind == "ssa"
        if ssa:
            b, n = model.b().float(), model.n().float()
            l_max = n * torch.sign(z_max) * torch.log1p(b * z_max.abs())
            ent = ssa_flash.attention_entropy(q, k, score="ssa", score_params={"b": model.b(), "n": model.n()},
                                              backend=model.backend)
        else:
            l_max = z_max
            ent = ssa_flash.attention_entropy(q, k, backend=model.backend)
        for variant in variants:
            adaptive = variant.endswith("adaptive")
            out, lse = model.attend(q, k, v, adaptive=adaptive, return_lse=True)
            pred = model.decoder(out[:, 0, 0]).argmax(-1)
            beta = beta_from_entropy(ent.float(), DEFAULT_POLY, DEFAULT_THRESHOLD)[0] if adaptive else 1.0
            w_max = torch.exp(beta * l_max - lse.float())
            s = stats[variant]
            s["correct"] += int((pred == target).sum())
            hits[variant].append((pred == target).cpu())
            s["weight_on_max"] += float(w_max.sum())
            if adaptive:  # the mean temperature factor applied
                s["beta"] = s.get("beta", 0.0) + float(beta.sum())
            s["entropy"] += float(ent.float().sum())
        left -= m
    out = {}
    N = cfg["eval_sets"]
    for variant, s in stats.items():
        acc = s["correct"] / N
        out[variant] = {"accuracy": acc, "accuracy_se": math.sqrt(max(acc * (1 - acc), 1e-12) / N),
                        "weight_on_max": s["weight_on_max"] / N,
                        "entropy_before_temperature": s["entropy"] / N}
        if "beta" in s:
            out[variant]["beta"] = s["beta"] / N
    for variant in variants:  # adaptive temperature vs the same model without it, on the same sets
        base = BASE.get(variant)
        if base in hits:
            new, old = torch.cat(hits[variant]), torch.cat(hits[base])
            out[variant]["paired_vs_" + base] = {"gained": int((new & ~old).sum()), "lost": int((~new & old).sum())}
    return out


# ---------------------------------------------------------------------------------------------
# Provenance, output


def plot(results, out_dir):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: skipping the plots (pip install matplotlib)")
        return []
    sizes = results["test_sizes"]
    styles = {"softmax": "o-", "adaptive": "s--", "ssa": "^-", "ssa_adaptive": "v--"}
    files = []
    for key, ylabel, fname in (("accuracy", "accuracy", "max_retrieval_accuracy.png"),
                               ("weight_on_max", "attention weight on the max item", "max_retrieval_sharpness.png")):
        fig, ax = plt.subplots(figsize=(5.5, 4))
        for variant in VARIANTS:
            ax.plot(sizes, [results["eval"][str(s)][variant][key] for s in sizes], styles[variant], label=variant)
        if key == "accuracy":
            for variant, mark in (("softmax", "rx"), ("adaptive", "r+")):
                pts = PAPER["accuracy"][variant]
                ax.plot([int(s) for s in pts], list(pts.values()), mark, ms=9, label=f"paper: {variant}")
            ax.axhline(1 / CLASSES, color="k", ls=":", lw=1, label="chance")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("items at test time (trained on 5-16)")
        ax.set_ylabel(ylabel)
        ax.set_title(f"max retrieval ({results['mode']})")
        ax.legend(fontsize=8)
        fig.tight_layout()
        path = os.path.join(out_dir, fname)
        fig.savefig(path, dpi=120)
        plt.close(fig)
        files.append(path)
    return files


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    g = p.add_mutually_exclusive_group()
    g.add_argument("--quick", action="store_true", help="tiny model, few steps: CPU smoke test (< 2 min)")
    g.add_argument("--smoke", action="store_true", help="even fewer steps and test sizes up to 1024 (unit tests)")
    g.add_argument("--preset", choices=sorted(PRESETS), help="named configuration (default: full)")
    p.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    p.add_argument("--steps", type=int)
    p.add_argument("--seed", type=int, default=0, help="init seed; train data uses seed+1, test sets seed+2")
    p.add_argument("--out", default=None, help="output folder (default: examples/results/max_retrieval-<mode> for full runs and "
                   "presets; --quick / --smoke: <tmp>/ssa_flash-examples/max_retrieval-<mode>, outside the checkout)")
    p.add_argument("--dim", type=int)
    p.add_argument("--batch", type=int)
    p.add_argument("--lr", type=float)
    p.add_argument("--eval-sets", type=int, dest="eval_sets", help="test sets per size")
    p.add_argument("--max-test", type=int, dest="max_test", help="largest test set size (power of 2)")
    p.add_argument("--backend", default="auto", choices=["auto", "triton", "cuda", "reference"])
    p.add_argument("--threads", type=int, default=None,
                   help="torch CPU threads (default on CPU: 1, faster than more for these tiny operations)")
    args = p.parse_args(argv)

    mode = "quick" if args.quick else "smoke" if args.smoke else (args.preset or "full")
    cfg = dict(PRESETS[mode])
    for key in ("steps", "dim", "batch", "lr", "eval_sets", "max_test"):
        if getattr(args, key) is not None:
            cfg[key] = getattr(args, key)
    cfg.update(seed=args.seed, data_seed=args.seed + 1, eval_seed=args.seed + 2, backend=args.backend,
               train_sizes=list(TRAIN_SIZES))
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if args.threads or device.type == "cpu":
        torch.set_num_threads(args.threads or 1)
    backend = resolved_backend(args.backend, device)
    if device.type == "cpu" and backend == "triton":
        print("note: TRITON_INTERPRET=1 runs the Triton kernels through the interpreter: very slow; "
              "pass --backend reference for the naive implementation")
    out_dir = args.out or default_out_dir("max_retrieval", mode)
    os.makedirs(out_dir, exist_ok=True)
    sizes = [s for s in TEST_SIZES if s <= cfg["max_test"]]

    print(f"max_retrieval [{mode}] on {device_name(device)}, backend {backend}: dim {cfg['dim']}, "
          f"{cfg['steps']} steps x batch {cfg['batch']}, test sizes {sizes[0]}..{sizes[-1]}")
    results = {"experiment": "max_retrieval", "mode": mode, "config": cfg, "test_sizes": sizes,
               "provenance": provenance("examples/max_retrieval.py", device, cfg, mode, backend), "paper": PAPER,
               "train": {}, "eval": {str(s): {} for s in sizes}, "ssa_params": None}
    t_start = time.time()
    for kind, variants in (("softmax", ("softmax", "adaptive")), ("ssa", ("ssa", "ssa_adaptive"))):
        model, curve, secs, skipped = train(kind, cfg, device, max(1, cfg["steps"] // 10))
        if skipped:
            print(f"  [{kind}] skipped {skipped} step(s) with non-finite gradients")
        results["train"][kind] = {"seconds": secs, "params": sum(p.numel() for p in model.parameters()),
                                  "curve": curve,
                                  "skipped_nonfinite_steps": skipped}
        t0 = time.time()
        for s in sizes:
            results["eval"][str(s)].update(evaluate(model, s, cfg, device, variants))
        results["train"][kind]["eval_seconds"] = time.time() - t0
        if kind == "ssa":
            results["ssa_params"] = {"b": model.b().item(), "n": model.n().item()}
    results["seconds_total"] = time.time() - t_start

    print(f"\naccuracy ({cfg['eval_sets']} test sets per size, the same sets for every variant; chance 0.10)")
    print(f"{'items':>6} " + " ".join(f"{v:>13}" for v in VARIANTS) + "   paper softmax / adaptive")
    for s in sizes:
        row = results["eval"][str(s)]
        paper = ""
        if str(s) in PAPER["accuracy"]["softmax"]:
            paper = f"   {PAPER['accuracy']['softmax'][str(s)]:.3f} / {PAPER['accuracy']['adaptive'][str(s)]:.3f}"
        print(f"{s:6d} " + " ".join(f"{row[v]['accuracy']:13.3f}" for v in VARIANTS) + paper)
    print(f"learned SSA b = {results['ssa_params']['b']:.3f}, n = {results['ssa_params']['n']:.3f}")

    results["plots"] = [os.path.basename(f) for f in plot(results, out_dir)]
    path = os.path.join(out_dir, "max_retrieval.json")
    with open(path, "w") as f:
        json.dump(results, f, indent=1)
    print(f"wrote {path}" + (f" and {', '.join(results['plots'])}" if results["plots"] else "")
          + f" ({results['seconds_total']:.0f}s)")
    return results


if __name__ == "__main__":
    main()
