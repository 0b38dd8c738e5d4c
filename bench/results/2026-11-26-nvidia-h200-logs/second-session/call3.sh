export PYTHONPATH=$PWD SSA_FLASH_AUTOTUNE=0; unset TRITON_INTERPRET
timeout 45 python3 - <<'PY'
import sys, torch; sys.path.insert(0, "tests")
from ssa_flash.triton import launch, tiles
from features import Row, check_row
orig = tiles.block_candidates
launch.block_candidates = lambda a, hb, dt, name, *x, **kw: [tiles.Blocks(16, 16, 4, 1)]
for desc, row in [("mask only", Row("ssa", mask="bool_empty_rows")), ("dropout only", Row("ssa", dropout_p=0.3)),
                  ("float mask+dropout", Row("ssa", mask="float", dropout_p=0.3))]:
    launch._chosen_blocks.clear()
    try:
        check_row(row, "triton", torch.float16); print(desc, "PASS", flush=True)
    except AssertionError as e:
        print(desc, "FAIL", str(e).splitlines()[0][:150], flush=True)
PY
