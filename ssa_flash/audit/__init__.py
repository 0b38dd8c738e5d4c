"""Static audit of the compiled kernels (docs/design.md §4.3): ``python -m ssa_flash.audit``.

Compiles, on a machine without a GPU, every kernel specialisation the Triton launcher can choose
(and the CUDA C++ kernels when nvcc is present) for a GPU target, and reads the compiled code:
registers, spills, shared memory, ptxas diagnostics, the tensor-core instructions of each main
loop against the source's matmuls, the instruction mix per score element and the throughput bound
it allows. A static bound, never a measurement. See docs/benchmarks.md ("Static audit").

Modules: ``specs`` (what is compiled), ``compile`` (Triton glue and NVIDIA tools), ``sass``
(SASS parsing, loops, instruction mix), ``ir`` (the source's dots from Triton IR), ``resources``
(``ptxas -v`` and ``cuobjdump -res-usage``), ``model`` (arch limits and the bound), ``analyse``
(figures of one kernel), ``runner`` (parallel runs, cache), ``report`` (table, JSON, compare),
``cuda`` (the CUDA C++ section), ``probe`` (a known kernel, for tests and toolchain checks).
"""
