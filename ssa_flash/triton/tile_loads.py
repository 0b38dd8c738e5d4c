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


@triton.jit
def row_descriptor(PTR, base, strides, head, n_rows, n_cols, BLOCK_ROWS: tl.constexpr, BLOCK_COLS: tl.constexpr):
    """A device-side tensor descriptor (TMA on sm_90) over the ``(n_rows, n_cols)`` rows of head
    ``head`` past ``base`` (:func:`~.extents.rows_base`) of a 4-D tensor with ``strides``, loading
    ``(BLOCK_ROWS, BLOCK_COLS)`` tiles; rows and columns past the extent read as zeros. The launcher
    guarantees what TMA needs: unit column stride, 16-byte aligned base and row stride."""
    return tl.make_tensor_descriptor(PTR + base + head * strides[1], shape=[n_rows, n_cols], strides=[strides[2], 1],
                                     block_shape=[BLOCK_ROWS, BLOCK_COLS])


@triton.jit
def load_block(desc, ptrs, start, stride, offs_rows, n_rows, n_cols, BLOCK_COLS: tl.constexpr,
               BOUNDARY: tl.constexpr, EVEN_D: tl.constexpr, DESCRIPTOR: tl.constexpr):
    """The tile of rows ``[start, start + rows)``: through the tensor descriptor ``desc``
    (:func:`row_descriptor`) with ``DESCRIPTOR``, else :func:`load_rows` on ``ptrs``."""
    if DESCRIPTOR:
        tile = desc.load([start, 0])
    else:
        tile = load_rows(ptrs, start, stride, offs_rows, n_rows, n_cols, BLOCK_COLS, BOUNDARY, EVEN_D)
    return tile
