"""The gradient of a learned additive mask (a bias that requires grad): a third backward kernel.

The logit row is ``l = phi(z) + mask`` (docs/design.md §1.2-1.4), so the gradient of the
mask's element ``(b, h, i, j)`` is the logit gradient ``dl_ij`` of that (batch, head)'s tile:

    dl = P' * (dO V^T - delta)                         (without the adaptive temperature)
    dl = beta * P' * (dO V^T - delta) - g * P * (log P + H)    (adaptive, g from the dQ kernel)

(with dropout ``dO V^T`` becomes ``r M (dO V^T)``, as in ``backward.py``). A bias of shape
``(L, S)``, ``(H, L, S)``, ``(1, H, L, S)`` or ``(B, 1, L, S)`` broadcasts over the batch and/or
the heads; its gradient is ``dl`` summed over those dims.

Design. The dQ and dK/dV kernels form ``dl`` per tile already, but neither can reduce over the
broadcast dims deterministically: a dK/dV program owns one key block of one (batch, key head)
and loops over the query blocks, so the sum over batch elements (and over heads of other key
heads) would span programs and need atomics or a ``(B, H, L, S)``-sized buffer of partials.
Here instead one program owns one ``(BLOCK_M, BLOCK_N)`` tile of the *gradient* (of the mask's
own, un-broadcast shape ``(Bm, Hm, L, S)``) and loops over the (batch, head) pairs that
broadcast onto it, in a fixed order (batch outer, head inner), recomputing ``P'`` and ``dO V^T``
for the tile from the row statistics the dQ kernel stored (``LSE2``, ``DELTA``, the recounted
LSE residuals, ``g``). So:

* no atomics and no ``(B, H, L, S)`` buffer: the result is written once per element, in a fixed
  summation order, hence bitwise equal across runs (``deterministic=True`` or not);
* it costs about one more dQ kernel (two matmuls per tile and (batch, head); the dQ kernel has
  three), and only to calls whose mask requires grad: the dQ and dK/dV kernels are unchanged (no
  new constexpr, no new argument), so every other call compiles to exactly the kernels it did.

A mask broadcast over query rows or keys (``(B, 1, 1, S)``, a key-padding bias) gets the
gradient of the ``(Bm, Hm, L, S)`` mask it expands to, summed over those dims afterwards by the
host: ``O(Bm Hm L S)`` memory, never ``(B, H, L, S)`` unless the mask is that big.

Every tile is treated as a boundary tile (index checks everywhere): the kernel is only paid by
learned-bias training, and a tile above the causal diagonal is skipped outright (written as 0).
Dense layout only (no packed batches: they take no mask).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .block_choice import on_device
from .dropout import tile_keep
from .extents import tile_ptrs
from .logits import LN2, LOG2E, bwd_head_coefficients, tile_logit_input_and_u
from .masks import MASK_ADD, boundary_logits

_ADDITIVE = tl.constexpr(MASK_ADD)  # (a global a kernel reads must be a constexpr)
from .prologue import dropout_scale, dropout_stream, logit_scales, window_edges


@triton.jit
def attention_bwd_mask_kernel(
    Q, K, V, DO, MASK, DMASK, row_stats, temperature, score_params,
    q_strides, k_strides, v_strides, do_strides, mask_strides, dmask_strides,
    dims, reduce, scale, dropout, window, softcap,
    SCORE: tl.constexpr, ADAPTIVE: tl.constexpr, CAUSAL: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    ACC: tl.constexpr, DOT_PRECISION: tl.constexpr, FAST_MATH: tl.constexpr,
    DROPOUT: tl.constexpr = False, WINDOW: tl.constexpr = False, SOFTCAP: tl.constexpr = False,
):
    """``DMASK[bm, hm, i, j] = sum over (b, h) broadcast onto (bm, hm) of dl[b, h, i, j]`` for one
    ``(BLOCK_M, BLOCK_N)`` tile (module docstring). ``dims = (B, H, Lq, Lk, D, DV, GROUP, num_m,
    num_n, Bm, Hm)``; ``reduce = (nb, nh)``: how many batch elements / heads fold onto one
    gradient element (``B`` or 1, ``H`` or 1). ``row_stats = (LSE2, DELTA, LSE2_LO, LSE_L2_HI,
    LSE_L2_LO)`` as the dK/dV kernel reads them (contiguous ``(B, H, Lq)``, written by the dQ
    kernel); ``temperature = (BETA, LSE_L, ENT, G)`` (adaptive; dummies without). ``MASK`` is the
    ``(B, H, Lq, Lk)`` expanded view the forward read (``mask_strides``), ``DMASK`` the contiguous
    ``(Bm, Hm, Lq, Lk)`` gradient in the accumulation dtype. Other arguments as in
    :func:`~.backward.attention_bwd_dkdv_kernel`."""
    B, H, Lq, Lk, D, DV, GROUP, num_m, num_n, Bm, Hm = dims
    nb, nh = reduce
    LSE2, DELTA, LSE2_LO, LSE_L2_HI, LSE_L2_LO = row_stats
    BETA, LSE_L, ENT, G = temperature
    pid = tl.program_id(0)
    n_blk = pid % num_n
    m_blk = (pid // num_n) % num_m
    ghm = (pid // (num_n * num_m)) % Hm
    gbm = pid // (num_n * num_m * Hm)
    start_m = m_blk * BLOCK_M
    start_n = n_blk * BLOCK_N
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    row_ok = offs_m < Lq
    col_ok = offs_n < Lk
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=ACC)
    # a tile wholly above the causal diagonal: every dl is 0, no (batch, head) is visited
    if CAUSAL:
        if start_n >= start_m + BLOCK_M:
            nb = 0
    scale, cap_a, cap_c = logit_scales(scale, softcap, SOFTCAP, ACC)
    P0, P1 = score_params
    win_left, win_right = window_edges(window, WINDOW)
    drop_scale = dropout_scale(dropout, DROPOUT, ACC)
    for ib in range(0, nb):  # fixed order: batch outer, head inner (deterministic)
        off_b = gbm + ib
        for ih in range(0, nh):
            off_h = ghm + ih
            off_kv = off_h // GROUP
            bh = off_b * H + off_h
            # (int64 batch offsets: a broadcast mask's (batch, head) loop spans the whole tensors)
            batch = off_b.to(tl.int64)
            q = tl.load(tile_ptrs(Q, batch * q_strides[0], q_strides, off_h, offs_m, offs_d),
                        mask=row_ok[:, None] & (offs_d[None, :] < D), other=0.0)
            do = tl.load(tile_ptrs(DO, batch * do_strides[0], do_strides, off_h, offs_m, offs_dv),
                         mask=row_ok[:, None] & (offs_dv[None, :] < DV), other=0.0)
            k = tl.load(tile_ptrs(K, batch * k_strides[0], k_strides, off_kv, offs_n, offs_d),
                        mask=col_ok[:, None] & (offs_d[None, :] < D), other=0.0)
            v = tl.load(tile_ptrs(V, batch * v_strides[0], v_strides, off_kv, offs_n, offs_dv),
                        mask=col_ok[:, None] & (offs_dv[None, :] < DV), other=0.0)
            row_stat = bh.to(tl.int64) * Lq + offs_m
            lse2 = tl.load(LSE2 + row_stat, mask=row_ok, other=0.0)
            lse2_lo = tl.load(LSE2_LO + row_stat, mask=row_ok, other=0.0)
            delta = tl.load(DELTA + row_stat, mask=row_ok, other=0.0)
            cb, coef, ds_scale = bwd_head_coefficients(P0, P1, off_h, scale, cap_c, SCORE, SOFTCAP, ACC)
            s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION, out_dtype=ACC)
            x, u, t = tile_logit_input_and_u(s, cb, cap_a, SCORE, SOFTCAP, ACC, FAST_MATH)
            mask_base = MASK + batch * mask_strides[0] + off_h.to(tl.int64) * mask_strides[1]
            l2 = boundary_logits(x * coef, offs_m, offs_n, Lq, Lk, mask_base, mask_strides[2],
                                 mask_strides[3], LOG2E, True, CAUSAL, _ADDITIVE, False,
                                 win_left, win_right, WINDOW)
            if ADAPTIVE:
                beta = tl.load(BETA + row_stat, mask=row_ok, other=1.0).to(ACC)
                p = tl.exp2(l2 * beta[:, None] - lse2[:, None] - lse2_lo[:, None])
            else:
                p = tl.exp2(l2 - lse2[:, None] - lse2_lo[:, None])
            dp = tl.dot(do, tl.trans(v), input_precision=DOT_PRECISION, out_dtype=ACC)
            if DROPOUT:
                keep = tile_keep(dropout_stream(dropout, off_b, off_h, DROPOUT), start_m, start_n, BLOCK_M, BLOCK_N,
                                 False, FAST_MATH)
                dl = p * (tl.where(keep, dp, 0.0) * drop_scale - delta[:, None])
            else:
                dl = p * (dp - delta[:, None])
            if ADAPTIVE:
                # the entropy path (backward.py): -g P (log P + H), P = softmax(l) untempered
                lse_l2 = tl.load(LSE_L2_HI + row_stat, mask=row_ok, other=0.0)
                lse_l2_lo = tl.load(LSE_L2_LO + row_stat, mask=row_ok, other=0.0)
                ent = tl.load(ENT + row_stat, mask=row_ok, other=0.0).to(ACC)
                g = tl.load(G + row_stat, mask=row_ok, other=0.0).to(ACC)
                admissible = l2 != float("-inf")
                log_p2 = tl.where(admissible, l2 - lse_l2[:, None] - lse_l2_lo[:, None], 0.0)
                ent_term = tl.where(admissible, tl.exp2(log_p2) * (log_p2 * LN2 + ent[:, None]), 0.0)
                dl = dl * beta[:, None] - g[:, None] * ent_term
            acc += dl
    out = (DMASK + gbm.to(tl.int64) * dmask_strides[0] + ghm.to(tl.int64) * dmask_strides[1]
           + offs_m[:, None].to(tl.int64) * dmask_strides[2] + offs_n[None, :] * dmask_strides[3])
    tl.store(out, acc.to(DMASK.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


def mask_grad(mask_shape, q, k, v, do, mask, score_params, row_stats, temperature, common_consts: dict,
              feat_args: dict, feat_consts: dict, softcap, scale_args: dict, group: int, adaptive: bool,
              block_dv: int, device_arch) -> torch.Tensor:
    """The gradient of the learned additive mask, of shape ``mask_shape`` (4-D, each dim 1 or the
    full ``(B, Hq, Lq, Lk)`` one), in the accumulation dtype; launched by
    :func:`~.launch.backward` after its dQ kernel (whose row statistics ``row_stats``,
    ``temperature`` it reads, module docstring). ``mask`` is the ``(B, Hq, Lq, Lk)`` expanded view."""
    B, H, Lq, D = q.shape
    Lk, DV = k.shape[2], v.shape[3]
    if tuple(mask.shape) != (B, H, Lq, Lk) or len(mask_shape) != 4:
        raise ValueError(f"mask_grad: mask {tuple(mask.shape)} / grad shape {tuple(mask_shape)} for "
                         f"(B, Hq, Lq, Lk) = {(B, H, Lq, Lk)}")
    Bm, Hm = int(mask_shape[0]), int(mask_shape[1])
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    # broadcast over rows or keys: the (Bm, Hm, Lq, Lk) gradient, summed below (module docstring)
    dmask = torch.empty((Bm, Hm, Lq, Lk), device=q.device, dtype=acc)
    # not tuned: the q, k, v, dO tiles of one (batch, head) live together, so the tile shrinks
    # with the head dim (16 x 16 under the interpreter, as the other kernels there)
    head_block = max(common_consts["BLOCK_D"], block_dv)
    bm, bn = (16, 16) if device_arch is None else ((64, 64) if head_block <= 64 else (64, 32) if head_block <= 128
                                                  else (32, 32))
    num_m, num_n = triton.cdiv(Lq, bm), triton.cdiv(Lk, bn)
    consts = {name: common_consts[name] for name in ("SCORE", "CAUSAL", "BLOCK_D", "ACC", "DOT_PRECISION",
                                                      "FAST_MATH")}
    consts.update(feat_consts)
    if softcap is not None:
        consts["SOFTCAP"] = True
    grid = (Bm * Hm * num_m * num_n,)
    if grid[0] > 0:
        with on_device(q.device):
            attention_bwd_mask_kernel[grid](
                q, k, v, do, mask, dmask, row_stats, temperature, score_params,
                tuple(q.stride()), tuple(k.stride()), tuple(v.stride()), tuple(do.stride()), tuple(mask.stride()),
                tuple(dmask.stride()), (B, H, Lq, Lk, D, DV, group, num_m, num_n, Bm, Hm),
                (B if Bm == 1 else 1, H if Hm == 1 else 1), scale_args["scale"], feat_args["dropout"],
                feat_args["window"], softcap, ADAPTIVE=adaptive, BLOCK_M=bm, BLOCK_N=bn, BLOCK_DV=block_dv,
                num_warps=8 if bm * bn >= 64 * 64 else 4, num_stages=1, **consts)
    dims = tuple(d for d in (2, 3) if mask_shape[d] == 1 and dmask.shape[d] != 1)
    return dmask.sum(dim=dims, keepdim=True) if dims else dmask
