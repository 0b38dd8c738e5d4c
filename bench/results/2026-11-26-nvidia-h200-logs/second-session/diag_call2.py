"""Throwaway GPU diagnostic 2 (not committed): the dropout + empty-row failure by block configuration
and allocator state; the adaptive extreme-b/n dq error with and without the fast-math approximations."""
import os, sys, time, traceback, tempfile
sys.path.insert(0, "tests")
os.environ["SSA_FLASH_CACHE_DIR"] = tempfile.mkdtemp()
import torch
import ssa_flash
from ssa_flash.triton import launch, tiles
import features
from features import Row, check_row
from attn_testing import check, make_qkv, DEVICE

dev = DEVICE
ROW = Row("ssa", dropout_p=0.3, mask="bool_empty_rows", dlse=True)


def poison():
    if dev == "cuda":
        x = torch.full((1 << 24,), float("nan"), device=dev)
        del x


def attempt(label, fn):
    t0 = time.time()
    try:
        fn()
        print(f"{label}: PASS ({time.time()-t0:.1f}s)", flush=True)
    except AssertionError as e:
        print(f"{label}: FAIL {str(e).splitlines()[0][:200]} ({time.time()-t0:.1f}s)", flush=True)
    except Exception as e:
        print(f"{label}: ERROR {type(e).__name__}: {str(e)[:300]}", flush=True)


def row_check(dtype=torch.float16):
    return lambda: check_row(ROW, "triton", dtype)


part = sys.argv[1] if len(sys.argv) > 1 else "all"
if part in ("all", "dropout"):
    # 1. autotuning on, fresh cache: first call tunes, the second reuses
    os.environ["SSA_FLASH_AUTOTUNE"] = "1"
    attempt("tuned first call (tunes)", row_check())
    attempt("tuned second call (cached)", row_check())
    poison(); attempt("tuned, allocator poisoned with NaN", row_check())
    # 2. each configuration forced, the others first-fit, allocator poisoned
    os.environ["SSA_FLASH_AUTOTUNE"] = "0"
    original = tiles.block_candidates
    for kernel in ("fwd", "bwd_dq", "bwd_dkdv"):
        arch = 10 * torch.cuda.get_device_capability()[0] + torch.cuda.get_device_capability()[1] if dev == "cuda" else None
        cands = original(arch, 16, torch.float16, kernel, masked=True, dropout=True)
        for i, c in enumerate(dict.fromkeys(cands)):
            def forced(arch_, hb, dt, name, *a, _k=kernel, _c=c, **kw):
                full = original(arch_, hb, dt, name, *a, **kw)
                return [_c] if name == _k else full
            launch.block_candidates = forced
            launch._chosen_blocks.clear()
            poison()
            attempt(f"forced {kernel} {c}", row_check())
        launch.block_candidates = original
    launch._chosen_blocks.clear()
    # 3. without the mask's empty rows / without dropout, first-fit, poisoned
    for desc, row in [("no dropout", Row("ssa", mask="bool_empty_rows", dlse=True)),
                      ("no dlse", Row("ssa", dropout_p=0.3, mask="bool_empty_rows")),
                      ("bool mask, no empty rows", Row("ssa", dropout_p=0.3, mask="bool", dlse=True)),
                      ("softmax", Row("softmax", dropout_p=0.3, mask="bool_empty_rows", dlse=True))]:
        poison(); attempt(f"first-fit {desc}", lambda row=row: check_row(row, "triton", torch.float16))
if part in ("all", "extreme"):
    os.environ["SSA_FLASH_AUTOTUNE"] = "0"
    launch._chosen_blocks.clear()
    q, k, v = make_qkv(Lq=19, Lk=21, D=16)
    for fm in (True, False):
        orig = launch._fast_math
        if not fm:
            launch._fast_math = lambda q: False
        for adaptive in (True, False):
            bt = torch.full((2,), 1000.0, device=dev, requires_grad=True)
            nt = torch.full((2,), 20.0, device=dev, requires_grad=True)
            attempt(f"extreme b=1000 n=20 adaptive={adaptive} fast_math={fm}",
                    lambda: check("ssa_adaptive" if adaptive else "ssa", q, k, v, bt, nt))
        launch._fast_math = orig
        launch._chosen_blocks.clear()
