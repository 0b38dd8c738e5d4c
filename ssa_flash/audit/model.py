"""Per-architecture limits and the throughput bound of docs/design.md §4.3.

Bound model, per SM and clock: ``ISSUE`` thread-instructions issued (4 schedulers x 32 lanes),
``MUFU`` special-function results, ``TENSOR`` dense 16-bit multiply-adds. For one score element
of a loop, ``time = max(instructions / ISSUE, mufu / MUFU, tensor multiply-adds / TENSOR)``
clocks; the largest term is the binding one. It ignores memory bandwidth, latency, occupancy and
dependency stalls: it is an upper bound on speed from the instruction stream, never a measurement.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Optional


@dataclass(frozen=True)
class ArchModel:
    """Limits of one compute capability and, where known, its throughput per SM and clock."""

    arch: int
    gpu: str
    smem_per_sm: int  # bytes usable by the CTAs of one SM
    smem_per_block: int  # largest dynamic shared memory a CTA may opt in to
    smem_reserved_per_block: int  # the system's share per resident CTA
    regs_per_sm: int
    max_threads_per_sm: int
    max_ctas_per_sm: int
    issue: Optional[int] = None  # thread-instructions per SM per clock
    mufu: Optional[int] = None  # MUFU results per SM per clock
    tensor16: Optional[int] = None  # dense fp16/bf16 multiply-adds per SM per clock
    peak_tflops: Optional[float] = None  # dense fp16/bf16, the product's figure

    @property
    def has_bound_model(self) -> bool:
        return None not in (self.issue, self.mufu, self.tensor16, self.peak_tflops)

    def tensor_rate(self, input_type: str) -> Optional[float]:
        """Multiply-adds per SM per clock for tensor instructions on ``input_type`` operands."""
        if self.tensor16 is None:
            return None
        return self.tensor16 * {"16bit": 1.0, "tf32": 0.5, "8bit": 2.0, "fp64": 1 / 16}.get(input_type, 1.0)


_KB = 1024
ARCHS: Dict[int, ArchModel] = {
    # Turing: 64 KB of shared memory per SM, all of it available to one block (no system share)
    75: ArchModel(75, "sm_75", 64 * _KB, 64 * _KB, 0, 65536, 1024, 16),
    80: ArchModel(80, "A100", 164 * _KB, 163 * _KB, _KB, 65536, 2048, 32, 128, 16, 1024, 312.0),
    86: ArchModel(86, "sm_86", 100 * _KB, 99 * _KB, _KB, 65536, 1536, 16),
    89: ArchModel(89, "sm_89", 100 * _KB, 99 * _KB, _KB, 65536, 1536, 24),
    90: ArchModel(90, "H100", 228 * _KB, 227 * _KB, _KB, 65536, 2048, 32, 128, 16, 2048, 989.0),
    100: ArchModel(100, "sm_100", 228 * _KB, 227 * _KB, _KB, 65536, 2048, 32),
    120: ArchModel(120, "sm_120", 100 * _KB, 99 * _KB, _KB, 65536, 1536, 32),
}


def arch_model(arch: int) -> ArchModel:
    """The :class:`ArchModel` of compute capability ``arch`` (e.g. 90)."""
    try:
        return ARCHS[int(arch)]
    except KeyError:
        raise ValueError(f"no audit model for sm_{arch}; known: {sorted(ARCHS)}") from None


def mma_input_type(kind: str) -> str:
    """``16bit``, ``tf32``, ``8bit`` or ``fp64`` from a tensor instruction kind such as
    ``HGMMA.64x64x16.F32.BF16``."""
    parts = set(kind.upper().split("."))
    if "TF32" in parts:
        return "tf32"
    if parts & {"E4M3", "E5M2", "S8", "U8", "S8.S8"} or kind.startswith(("QGMMA", "IGMMA", "IMMA")):
        return "8bit"
    if kind.startswith("DMMA"):
        return "fp64"
    return "16bit"


def occupancy(model: ArchModel, registers: int, threads: int, shared_bytes: int) -> Dict[str, int]:
    """Resident CTAs per SM allowed by registers, shared memory and threads (the minimum rules).

    Registers are allocated per warp in units of 256 (8 per thread)."""
    regs = max(1, -(-registers // 8) * 8)
    warps = -(-threads // 32)
    by_regs = model.regs_per_sm // (regs * 32 * warps)
    by_smem = (model.smem_per_sm // (shared_bytes + model.smem_reserved_per_block) if shared_bytes
               else model.max_ctas_per_sm)
    by_threads = model.max_threads_per_sm // threads
    return {"ctas_per_sm": max(0, min(by_regs, by_smem, by_threads, model.max_ctas_per_sm)),
            "limited_by_registers": by_regs, "limited_by_shared": by_smem, "limited_by_threads": by_threads}


def bound(model: ArchModel, instructions: float, mufu: float, macs_by_type: Dict[str, float],
          useful_macs: float) -> Optional[dict]:
    """The bound of docs/design.md §4.3 for one score element.

    ``instructions``, ``mufu``: thread-instructions per element; ``macs_by_type``: multiply-adds per
    element the tensor instructions perform, by input type; ``useful_macs``: multiply-adds per
    element of the source's matmuls. Returns the time per element in SM clocks of each term, the
    binding term, and the matmul TFLOP/s this allows (the source's matmuls at the arch's peak)."""
    if not model.has_bound_model:
        return None
    t_issue = instructions / model.issue
    t_mufu = mufu / model.mufu
    t_tensor = sum(v / model.tensor_rate(k) for k, v in macs_by_type.items())
    terms = {"issue": t_issue, "mufu": t_mufu, "tensor": t_tensor}
    binding = max(terms, key=terms.get)
    t = terms[binding]
    ideal = useful_macs / model.tensor16
    frac = ideal / t if t > 0 else 0.0
    return {"clocks_per_element": t, "issue_clocks": t_issue, "mufu_clocks": t_mufu, "tensor_clocks": t_tensor,
            "binding": binding, "fraction_of_peak": frac, "tflops": frac * model.peak_tflops}
