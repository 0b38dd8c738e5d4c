"""Loading a block of rows (keys, values) inside a loop stage: boundary stages check the rows against
the sequence end and the columns against the head dim; interior stages check nothing when the head
dim fills its tile (``EVEN_D``), the columns only otherwise."""
import triton
import triton.language as tl


@triton.jit
def load_rows(ptrs, start, stride, offs_rows, n_rows, n_cols, BLOCK_COLS: tl.constexpr,
              BOUNDARY: tl.constexpr, EVEN_D: tl.constexpr):
    """The ``(rows, BLOCK_COLS)`` tile at ``ptrs + start * stride`` (``ptrs`` holds the tile's
    offsets from row 0), zero outside ``n_rows`` rows (``offs_rows`` the rows' positions, checked
    in BOUNDARY stages only) and ``n_cols`` columns."""
    offs_c = tl.arange(0, BLOCK_COLS)
    if BOUNDARY:
        row_ok = offs_rows[:, None] < n_rows  # audit: boundary-only
        tile = tl.load(ptrs + start * stride, mask=row_ok & (offs_c[None, :] < n_cols), other=0.0)
    elif EVEN_D:
        tile = tl.load(ptrs + start * stride)
    else:
        tile = tl.load(ptrs + start * stride, mask=offs_c[None, :] < n_cols, other=0.0)
    return tile
