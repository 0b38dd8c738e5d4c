"""The verdict matrix of the sm_90a warp-specialised forward, shared by its CPU emulation
(test_hopper_fwd_emulated.py, the kernel called directly) and its GPU run
(test_hopper_fwd_device.py, through backend="cuda"): every score function x with / without the
adaptive temperature, each on two of the shapes below in rotation."""
from __future__ import annotations

import torch

from ssa_flash import scores

BF16, FP16 = torch.bfloat16, torch.float16
SCORE_NAMES = [f.name for f in scores.SCORES.values()]
# (dtype, B, H, Hkv, Lq, Lk, D, Dv, causal): one key block, ragged lengths, Lq != Lk (both ways),
# GQA 2:1 and 4:1, a D below the padded one (TMA's zero fill of the columns), Dv != D; D 64 / 128
# (padded), float16 and bfloat16, causal and not
SHAPES = [
    (BF16, 1, 2, 2, 128, 128, 64, 64, True),
    (FP16, 1, 2, 1, 200, 333, 128, 128, False),
    (BF16, 2, 4, 1, 77, 260, 64, 48, True),
    (FP16, 1, 2, 2, 300, 130, 120, 128, True),
    (FP16, 1, 2, 1, 129, 129, 64, 64, False),
    (BF16, 1, 2, 2, 256, 384, 128, 112, True),
]
# (score, adaptive, *shape)
MATRIX = [(score, adaptive, *SHAPES[(3 * i + j + shift) % len(SHAPES)])
          for shift in (0, 1) for i, score in enumerate(SCORE_NAMES) for j, adaptive in enumerate((False, True))]
