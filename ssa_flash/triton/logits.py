"""The score functions in the kernels: from the raw dot products of a tile to base-2 logits, the
per-head coefficients this needs, the derivative of the logit with respect to the score and each
per-head parameter's gradient terms.

Kernels are compiled for one score function, ``SCORE: tl.constexpr`` (its registry id,
``ssa_flash.scores``); every helper here branches on it statically, so a kernel contains only its
score function's code. The kernels see per-head parameters as two pointers ``P0, P1`` (the
parameters in registry order; dummies where a function has fewer) and write two per-program
gradient partial sums (:func:`store_param_grads`); what differs between score functions is all
in this module. A new score function with at most two parameters is a new branch in each
``@triton.jit`` helper below that tests ``SCORE`` (and :func:`poly_exp2_pays` if it is
MUFU-heavy).

Logits are kept in base-2 units (``l2 = l * log2(e)``) so that the exponentials are ``exp2``, and
each tile is built from the raw dot products ``s = q . k`` (the softmax scale is folded into
per-row coefficients, never applied element by element):

* softmax:  ``x = s``                                      ``l2 = x * (scale * log2(e))``
* SSA:      ``x = sgn(s) * log2(1 + scale * b * |s|)``     ``l2 = x * n``
  (= ``phi(z) * log2(e)`` with ``z = scale * s``; ``(1 + b|z|)^n`` is never formed, so large
  ``n`` or ``|z|`` cannot overflow)
* logit scale: ``x = s``                                   ``l2 = x * (s_h * scale * log2(e))``
  (softmax's ``x`` with the head's ``s_h >= 0`` in the coefficient; ``s_h = 0``: every logit 0)

With the adaptive temperature the row's ``beta`` multiplies the coefficient too, so an interior
tile turns ``x`` into its weights with one fused multiply-add and one ``exp2`` per element:
``p = exp2(x * coef_row - m_row)``. What makes an element inadmissible (sequence ends, causality,
a window, an attention mask) is applied to ``l2`` afterwards: ``masks.py``.

Soft-capping (``SOFTCAP``, docs/maths.md §6.1) replaces the scaled score ``z = scale s`` by
``z' = c tanh(z / c)`` before the transform. With ``t = tanh(|scale| s / c)`` (one multiply and one
tanh per element; ``sgn(t) = sgn(s)``, ``|z'| = c |t|``) the same formulas hold with ``t`` in place
of ``s`` and ``c`` in place of ``|scale|``: softmax ``x = t``, ``coef = c log2(e)``; SSA
``x = sgn(t) log2(1 + b c |t|)``. The sign of the scale stays in ``q_sign`` (forward) or ``coef``
(backward) as without the cap.

Attention sinks (``SINKS``, §6.2): a row starts from its sink logit instead of from nothing
(:func:`row_start`), which is all the forward and the statistics pass need.
"""
import triton
import triton.language as tl

from ..scores import LOGIT_SCALE, SOFTMAX, SSA, ScoreFunction
from .fast_math import copy_sign, exp2_poly, fast_recip, fast_tanh

LOG2E = tl.constexpr(1.4426950408889634)
LN2 = tl.constexpr(0.6931471805599453)

# the registry ids the kernels' SCORE constexpr takes
SOFTMAX_ID = tl.constexpr(SOFTMAX.id)
SSA_ID = tl.constexpr(SSA.id)
LOGIT_SCALE_ID = tl.constexpr(LOGIT_SCALE.id)

#: Per-head parameters the kernels take (``P0, P1``) and whose gradients they sum (``dP0, dP1``).
MAX_PARAMS = 2


def kernel_params(f: ScoreFunction, params, dummy) -> tuple:
    """``(P0, P1)``: score function ``f``'s per-head parameter tensors in registry order, ``dummy``
    (any tensor, never read) for those it lacks. ``ValueError`` for a wrong count."""
    params = tuple(params)
    if len(params) != len(f.params):
        raise ValueError(f"ssa_flash: score function {f.name!r} takes {len(f.params)} parameter(s) "
                         f"{f.params}, got {len(params)}")
    if len(params) > MAX_PARAMS:
        raise ValueError(f"ssa_flash: the Triton kernels take at most {MAX_PARAMS} per-head parameters, "
                         f"{f.name!r} has {len(params)}")
    return params + (dummy,) * (MAX_PARAMS - len(params))


def poly_exp2_pays(score: ScoreFunction) -> bool:
    """Whether the score function's tiles are MUFU-bound enough at small head dims for the
    polynomial ``exp2`` (``kernel_args.poly_exp2_degree``): SSA's ``log2`` and reciprocal."""
    return score is SSA


@triton.jit
def implemented(SCORE: tl.constexpr):
    """A compile error unless this module has the maths of score function ``SCORE`` (a score
    function added to the registry without its branches here must not compile as another one, the
    helpers' default branch). Called by the per-head setup every kernel runs. (A ``tl.static_assert``
    over the ids, not a ``triton.constexpr_function``: Triton 3.4, the floor, has none.)"""
    tl.static_assert((SCORE == SOFTMAX_ID) or (SCORE == SSA_ID) or (SCORE == LOGIT_SCALE_ID),
                     "ssa_flash: the Triton kernels have no maths for this score function id "
                     "(ssa_flash/triton/logits.py)")



@triton.jit
def ssa_log_weight(s, cb, ACC: tl.constexpr, FAST_MATH: tl.constexpr):
    """``(x, u)`` with ``u = 1 + cb |s|`` and ``x = sgn(s) log2(1 + cb |s|)``: SSA's log-weight of
    the raw dot products ``s`` divided by ``n`` (``cb = |scale| b``). The backward needs ``u`` too.

    In float32 ``log2(u)`` of the rounded ``u`` is what the GPU computes (its absolute error,
    2^-24 from rounding ``u``, is irrelevant as argued in :func:`.fast_math.fast_log2`). In float64 (the
    gradient checks) ``log(u) * y / (u - 1)`` with ``y = cb |s|`` cancels the rounding error of
    ``u`` (Goldberg), keeping ``log1p``'s relative accuracy for small ``y``."""
    y = tl.abs(s) * cb
    u = y + 1.0
    if ACC == tl.float64:
        d = u - 1.0
        t = tl.where(d == 0.0, y * LOG2E, tl.log2(u) * (y / tl.where(d == 0.0, 1.0, d)))
        return copy_sign(t, s, ACC), u
    elif FAST_MATH:
        # MUFU.LG2, then one LOP3 (t | (s & 0x80000000); lut 0xF8) for the sign: ptxas does not
        # fuse the AND and OR of copy_sign across the opaque lg2.
        x = tl.inline_asm_elementwise(
            "{ .reg .f32 t; lg2.approx.ftz.f32 t, $1; lop3.b32 $0, t, $2, 0x80000000, 0xF8; }",
            "=f,f,f", [u, s], dtype=tl.float32, is_pure=True, pack=1)
        return x, u
    else:
        return copy_sign(tl.log2(u), s, ACC), u


@triton.jit
def capped_score(s, cap_a, SOFTCAP: tl.constexpr, ACC: tl.constexpr, FAST_MATH: tl.constexpr):
    """``t = tanh(cap_a s)`` with ``cap_a = |scale| / c`` under ``SOFTCAP`` (module docstring),
    ``s`` itself otherwise."""
    if SOFTCAP:
        return fast_tanh(s * cap_a, ACC, FAST_MATH)
    else:
        return s


@triton.jit
def tile_logit_input(s, cb, cap_a, SCORE: tl.constexpr, SOFTCAP: tl.constexpr, ACC: tl.constexpr,
                     FAST_MATH: tl.constexpr):
    """``x``, the per-element input of the logit (``l2 = x * coef``): SSA's signed
    ``log2(1 + cb|s|)``, ``s`` itself for softmax and the logit scale; ``s`` soft-capped first
    under ``SOFTCAP``."""
    s = capped_score(s, cap_a, SOFTCAP, ACC, FAST_MATH)
    if SCORE == SSA_ID:
        x, _ = ssa_log_weight(s, cb, ACC, FAST_MATH)
        return x
    else:
        return s


@triton.jit
def tile_logit_input_and_u(s, cb, cap_a, SCORE: tl.constexpr, SOFTCAP: tl.constexpr, ACC: tl.constexpr,
                           FAST_MATH: tl.constexpr):
    """The backward's form of :func:`tile_logit_input`: ``(x, u, t)`` with SSA's ``u = 1 + cb|t|``
    (``dx/dt = cb / (u ln 2)`` up to the sign, see :func:`ssa_reciprocal`; softmax's and the logit
    scale's ``x = t`` have ``dx/dt = 1`` and ``u`` is unused, 1) and ``t`` the capped score (``s``
    without ``SOFTCAP``), whose ``dt/ds = cap_a (1 - t^2)``."""
    t = capped_score(s, cap_a, SOFTCAP, ACC, FAST_MATH)
    if SCORE == SSA_ID:
        x, u = ssa_log_weight(t, cb, ACC, FAST_MATH)
    else:
        x = t
        u = 1.0
    return x, u, t


@triton.jit
def row_start(BLOCK_M: tl.constexpr, ACC: tl.constexpr, sink_l2, SINKS: tl.constexpr):
    """``(m, total)``: a row's running maximum of base-2 logits and its running sum of weights
    before any key is seen; the online softmax of the forward and the statistics pass starts from
    here. Without ``SINKS``: ``-inf`` and 0. With: the row's sink logit ``sink_l2`` (base 2,
    ``(BLOCK_M,)``, times ``beta`` where the temperature applies) and its weight 1, or the empty
    row again where ``sink_l2`` is ``-inf`` (no sink)."""
    if SINKS:
        return sink_l2, tl.where(sink_l2 == float("-inf"), 0.0, 1.0).to(ACC)
    else:
        return tl.full((BLOCK_M,), float("-inf"), dtype=ACC), tl.zeros((BLOCK_M,), dtype=ACC)


@triton.jit
def softcap_ratio(scale, softcap, ACC: tl.constexpr):
    """``(cap_a, c)``: ``|scale| / c`` and the cap ``c`` (``softcap = (hi, lo)`` split as the scale
    is); both unused (1) without ``SOFTCAP``."""
    c = combine_scale(softcap[0], softcap[1], ACC)
    return tl.abs(scale) / c, c


@triton.jit
def ssa_reciprocal(u, x, ROWS: tl.constexpr, COLS: tl.constexpr, FAST_MATH: tl.constexpr,
                   POLY_EXP2: tl.constexpr):
    """``1 / u`` of SSA's ``u = 1 + b|z|`` (``x = sgn(s) log2(u)``, already computed): with
    ``POLY_EXP2``, every other column is ``2^-|x|`` on the FMA pipe, the rest ``rcp.approx``."""
    if POLY_EXP2 != 0:
        u_hw, _ = tl.split(tl.reshape(u, (ROWS, COLS // 2, 2)))
        _, x_poly = tl.split(tl.reshape(x, (ROWS, COLS // 2, 2)))
        r = tl.join(fast_recip(u_hw, FAST_MATH), exp2_poly(-tl.abs(x_poly), POLY_EXP2))
        return tl.reshape(r, (ROWS, COLS))
    else:
        return fast_recip(u, FAST_MATH)


@triton.jit
def combine_scale(scale_hi, scale_lo, ACC: tl.constexpr):
    """The softmax scale as an ACC-dtype value. Python floats reach kernels as float32, so the
    launcher splits the scale into a float32 head and its remainder; in float64 they add up exactly."""
    zero = tl.zeros((1,), dtype=ACC)
    return tl.sum(zero + scale_hi, 0) + scale_lo


@triton.jit
def head_coefficients(P0, P1, off_h, scale, cap_c, SCORE: tl.constexpr, SOFTCAP: tl.constexpr,
                      ACC: tl.constexpr):
    """``(cb, coef, q_sign)`` of one head (forward and statistics pass). ``cb = |scale| * b`` is
    SSA's argument scale (unused otherwise); ``coef >= 0`` is the factor from ``x`` to base-2
    logits (``|n|`` for SSA, ``|scale| * log2(e)`` for softmax, times ``s_h`` for the logit
    scale); ``q_sign`` (+1 or -1) is the sign of ``n * scale`` (SSA) or ``scale``. Kernels
    multiply the queries by ``q_sign`` once per program, so that the logits are ``x * coef`` with
    ``coef >= 0`` and a tile's row maximum is that of ``x`` times ``coef`` (no per-element sign
    work for negative ``n`` or ``scale``). Under ``SOFTCAP`` the cap ``cap_c`` takes the place of
    ``|scale|`` (module docstring). ``P0, P1``: the parameters (SSA: ``b, n``; logit scale: ``s``)."""
    implemented(SCORE)
    scale_sign = tl.where(scale < 0, -1.0, 1.0)
    if SCORE == SSA_ID:
        n = tl.load(P1 + off_h).to(ACC)
        if SOFTCAP:
            cb = tl.load(P0 + off_h).to(ACC) * cap_c
        else:
            cb = tl.load(P0 + off_h).to(ACC) * (scale * scale_sign)
        coef = tl.abs(n)
        q_sign = tl.where(n < 0, -scale_sign, scale_sign)
    else:
        cb = scale * scale_sign
        if SOFTCAP:
            cb = cap_c
        coef = cb * LOG2E
        if SCORE == LOGIT_SCALE_ID:  # s_h >= 0 (ssa_flash.scores): coef stays >= 0
            coef = coef * tl.load(P0 + off_h).to(ACC)
        q_sign = scale_sign
    return cb, coef, q_sign


@triton.jit
def bwd_head_coefficients(P0, P1, off_h, scale, cap_c, SCORE: tl.constexpr, SOFTCAP: tl.constexpr,
                          ACC: tl.constexpr):
    """The backward's ``(cb, coef, ds_scale)`` of one head: ``cb = |scale| b``; ``coef`` turns
    ``x`` into base-2 logits with its sign (``n sgn(scale)`` for SSA, ``scale log2(e)`` for
    softmax, times ``s_h`` for the logit scale); ``ds_scale = dl/ds`` without the per-element
    factor of :func:`dscore_factor` (``n b scale``, ``scale``, ``s_h scale``). Under ``SOFTCAP``
    the cap ``cap_c`` replaces ``|scale|`` in ``cb`` and ``coef`` (module docstring); ``ds_scale``
    then also lacks the per-element ``1 - t^2``."""
    implemented(SCORE)
    scale_sign = tl.where(scale < 0, -1.0, 1.0)
    if SCORE == SSA_ID:
        b = tl.load(P0 + off_h).to(ACC)
        n = tl.load(P1 + off_h).to(ACC)
        if SOFTCAP:
            cb = b * cap_c
        else:
            cb = b * (scale * scale_sign)
        coef = n * scale_sign
        ds_scale = n * b * scale
    else:
        cb = scale * scale_sign
        if SOFTCAP:
            cb = cap_c
        coef = scale * LOG2E
        if SOFTCAP:
            coef = cap_c * scale_sign * LOG2E
        ds_scale = scale
        if SCORE == LOGIT_SCALE_ID:
            s_h = tl.load(P0 + off_h).to(ACC)
            coef = coef * s_h
            ds_scale = scale * s_h
    return cb, coef, ds_scale


@triton.jit
def dscore_factor(ds, u, x, t, SCORE: tl.constexpr, SOFTCAP: tl.constexpr, ROWS: tl.constexpr,
                  COLS: tl.constexpr, FAST_MATH: tl.constexpr, POLY_EXP2: tl.constexpr):
    """``ds`` times the per-element part of ``dl/ds`` (the dK/dV kernel's tiles, ``(ROWS, COLS)``):
    SSA's ``1 / u``; ``dz'/dz = 1 - t^2`` under ``SOFTCAP``; nothing else for softmax and the
    logit scale (their ``dl/ds`` is per head)."""
    if SCORE == SSA_ID:
        ds = ds * ssa_reciprocal(u, x, ROWS, COLS, FAST_MATH, POLY_EXP2)
    if SOFTCAP:  # dz'/dz
        ds = ds * (1.0 - t * t)
    return ds


@triton.jit
def dq_tile_terms(dl, ent_term, x, u, t, acc0, acc1, ent0, ent1, SCORE: tl.constexpr,
                  ADAPTIVE: tl.constexpr, SOFTCAP: tl.constexpr, ROWS: tl.constexpr, COLS: tl.constexpr,
                  FAST_MATH: tl.constexpr, POLY_EXP2: tl.constexpr):
    """One dQ tile's ``(ds, ent_ds, acc0, acc1, ent0, ent1)``: ``ds = dl * (dl/ds)`` up to the
    per-head ``ds_scale`` (and ``ent_ds`` likewise of the entropy term ``ent_term``, ``ADAPTIVE``
    only), and the per-row partial sums of the parameters' gradients (``acc0, acc1``: of ``dl``
    times each parameter's per-element weight, ``ent0, ent1``: of ``ent_term`` times it), ``(ROWS,
    COLS)`` tiles, ``(ROWS,)`` sums. Unscaled; :func:`store_param_grads` applies the per-head
    factors.

    * SSA: ``dl/ds ~ 1 / u``; ``dn ~ sum dl x``; ``db`` from ``dQ`` (backward.py) except under
      ``SOFTCAP``: ``db ~ sum dl t / u``.
    * logit scale: ``d s_h ~ sum dl t``, from ``dQ`` as SSA's ``db`` except under ``SOFTCAP``.
    """
    ent_ds = ent_term
    if SCORE == SSA_ID:
        r = ssa_reciprocal(u, x, ROWS, COLS, FAST_MATH, POLY_EXP2)
        r_t = r
        if SOFTCAP:  # dz'/dz = 1 - t^2; db sees the capped score
            r_t = r * t
            acc0 += tl.sum(dl * r_t, 1)
            r = r * (1.0 - t * t)
        ds = dl * r
        acc1 += tl.sum(dl * x, 1)
        if ADAPTIVE:
            ent1 += tl.sum(ent_term * x, 1)
            if SOFTCAP:
                ent0 += tl.sum(ent_term * r_t, 1)
            ent_ds = ent_term * r
    else:
        if SCORE == LOGIT_SCALE_ID:
            if SOFTCAP:  # z' = c sgn(scale) t
                acc0 += tl.sum(dl * t, 1)
                if ADAPTIVE:
                    ent0 += tl.sum(ent_term * t, 1)
        ds = dl
        if SOFTCAP:
            ds = dl * (1.0 - t * t)
        if ADAPTIVE:
            if SOFTCAP:
                ent_ds = ent_term * (1.0 - t * t)
    return ds, ent_ds, acc0, acc1, ent0, ent1


@triton.jit
def store_param_grads(q, dq, acc0, acc1, P0, P1, DP0_PART, DP1_PART, slot, off_h, scale, cap_c,
                      SCORE: tl.constexpr, SOFTCAP: tl.constexpr, ACC: tl.constexpr):
    """Stores one dQ program's partial sums of the parameters' gradients in its slot of
    ``DP0_PART`` (``DP1_PART``), ``bh * num_m_blocks + m_block`` with ``slot = (bh, num_m_blocks,
    m_block)``, from its rows' :func:`dq_tile_terms` sums (``acc0, acc1``, the
    temperature's terms already subtracted) and its query tile ``q`` and unscaled ``dq``
    (``sum_j dl_ij k_j``, before ``ds_scale``); rows past ``Lq`` have ``q = 0`` and zero sums.
    Nothing for a score function without parameters.

    SSA: ``db = n scale sum(dl s / u) = n scale sum_i q_i . dq_i``, under ``SOFTCAP``
    ``db = n c sgn(scale) sum(dl t / u)`` (``z' = c sgn(scale) t``); ``dn = sgn(scale) ln2 sum(dl x)``.
    Logit scale: ``d s_h = sum dl z' = scale sum_i q_i . dq_i``, under ``SOFTCAP``
    ``c sgn(scale) sum(dl t)``."""
    bh, num_m_blocks, m_block = slot
    scale_sign = tl.where(scale < 0, -1.0, 1.0).to(ACC)  # (a float32 literal otherwise)
    if SCORE == SSA_ID:
        n = tl.load(P1 + off_h).to(ACC)
        if SOFTCAP:
            tl.store(DP0_PART + bh * num_m_blocks + m_block, tl.sum(acc0, 0) * (n * cap_c * scale_sign))
        else:
            q_dq = tl.sum(tl.sum(q.to(ACC) * dq, 1), 0)
            tl.store(DP0_PART + bh * num_m_blocks + m_block, q_dq * (n * scale))
        tl.store(DP1_PART + bh * num_m_blocks + m_block, tl.sum(acc1, 0) * (scale_sign * LN2))
    elif SCORE == LOGIT_SCALE_ID:
        if SOFTCAP:
            tl.store(DP0_PART + bh * num_m_blocks + m_block, tl.sum(acc0, 0) * (cap_c * scale_sign))
        else:
            tl.store(DP0_PART + bh * num_m_blocks + m_block, tl.sum(tl.sum(q.to(ACC) * dq, 1), 0) * scale)


@triton.jit
def safe_row_max(m):
    """The running max with ``-inf`` (a row with nothing admissible yet) replaced by 0, so that
    ``exp2(l2 - m)`` gives 0 instead of NaN."""
    return tl.where(m == float("-inf"), 0.0, m)
