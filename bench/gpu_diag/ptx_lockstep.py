"""A small lockstep interpreter for the PTX that Triton emits for one CTA: every thread of the
block executes each instruction before any thread executes the next (so bar.sync is a no-op and
shfl.sync sees all lanes' operands), branches must be uniform across the block. It implements the
instruction subset of the reduced kernels in bool_mask_repro.py (integer arithmetic, predicates,
byte permutes, warp shuffles, shared and global loads / stores, a few f32 operations) and raises on
anything else. Purpose: check, without a GPU, whether the PTX Triton generated computes what the
Triton program means -- if it does, a wrong result on the GPU comes from ptxas / the hardware, not
from Triton's PTX.

    python bench/gpu_diag/ptx_lockstep.py KERNEL.ptx   # parses and lists unsupported opcodes

Used by bench/gpu_diag/check_ptx_keep.py. Not a general PTX emulator (no divergence, no async
copies, no tensor-core instructions, no memory model).
"""
from __future__ import annotations

import re
import struct
import sys

M = {8: 0xFF, 16: 0xFFFF, 32: 0xFFFFFFFF, 64: 0xFFFFFFFFFFFFFFFF}


def _bits(t):
    m = re.search(r"(\d+)$", t)
    return int(m.group(1)) if m else 32


def _signed(v, n):
    v &= M[n]
    return v - (1 << n) if v >> (n - 1) else v


def _f32(v):
    return struct.unpack("<f", struct.pack("<I", v & M[32]))[0]


def _from_f32(x):
    try:
        return struct.unpack("<I", struct.pack("<f", x))[0]
    except OverflowError:
        return 0x7F800000 if x > 0 else 0xFF800000


def _f16(v):
    return struct.unpack("<e", struct.pack("<H", v & 0xFFFF))[0]


def _bf16(v):
    return _f32((v & 0xFFFF) << 16)


def _to_f16(x):
    try:
        return struct.unpack("<H", struct.pack("<e", x))[0]
    except OverflowError:
        return 0x7C00 if x > 0 else 0xFC00


def _split_operands(s):
    out, depth, cur = [], 0, ""
    for ch in s:
        if ch in "[{":
            depth += 1
        elif ch in "]}":
            depth -= 1
        if ch == "," and depth == 0:
            out.append(cur.strip())
            cur = ""
        else:
            cur += ch
    if cur.strip():
        out.append(cur.strip())
    return out


def _fop(base, a):
    import math
    if base == "add":
        return a[0] + a[1]
    if base == "sub":
        return a[0] - a[1]
    if base == "mul":
        return a[0] * a[1]
    if base == "fma":
        return a[0] * a[1] + a[2]
    if base in ("max", "min"):  # PTX: NaN operands are ignored
        x = [v for v in a if not math.isnan(v)]
        return (max(x) if base == "max" else min(x)) if x else float("nan")
    if base == "neg":
        return -a[0]
    if base == "abs":
        return abs(a[0])
    if base == "div":
        if a[1] == 0:
            if a[0] == 0 or math.isnan(a[0]):
                return float("nan")
            return math.copysign(float("inf"), a[0]) * math.copysign(1, a[1])
        return a[0] / a[1]
    if base == "lg2":
        return math.log2(a[0]) if a[0] > 0 else (float("-inf") if a[0] == 0 else float("nan"))
    if base == "rcp":
        return 1.0 / a[0] if a[0] != 0 else math.copysign(float("inf"), a[0])
    if base == "sqrt":
        return math.sqrt(a[0]) if a[0] >= 0 else float("nan")
    if base == "rsqrt":
        return 1.0 / math.sqrt(a[0]) if a[0] > 0 else (float("inf") if a[0] == 0 else float("nan"))
    if base == "ex2":
        try:
            return 2.0 ** a[0]
        except OverflowError:
            return float("inf")
    raise NotImplementedError(base)


class Program:
    def __init__(self, ptx: str):
        body = ptx[ptx.index(".entry"):]
        self.params = re.findall(r"\.param\s+\.(\w+)(?:\s+\.ptr\s+\.global\s+\.align\s+\d+)?\s+(\w+)",
                                 body[:body.index(")")])
        body = body[body.index("{") + 1:]
        # the function ends at the first '}' at column 0 (the debug sections follow)
        body = body[:re.search(r"^}", body, re.M).start()]
        self.instrs, self.labels = [], {}
        for line in body.splitlines():
            line = line.split("//")[0].strip()
            if not line or line.startswith((".loc", ".reg", ".file", ".pragma")):
                continue
            if re.match(r"^[$\w]+:$", line):
                self.labels[line[:-1]] = len(self.instrs)
                continue
            local = {}
            if line.startswith("{") and line.endswith("}"):  # an inline-asm scope on one line
                line = line[1:-1]
                for decl in re.findall(r"\.reg\s+\.\w+\s+([\w, ]+);", line):
                    for name in decl.split(","):
                        local[name.strip()] = f"%__scope{len(self.instrs)}_{name.strip()}"
                line = re.sub(r"\.reg\s+\.\w+\s+[\w, ]+;", "", line)
            for stmt in line.split(";"):
                stmt = stmt.strip()
                if stmt in ("{", "}"):
                    continue
                if stmt:
                    for name, new in local.items():
                        stmt = re.sub(rf"(?<![%\w.]){name}(?!\w)", new, stmt)
                    self.instrs.append(self._parse(stmt))

    @staticmethod
    def _parse(stmt):
        pred = None
        m = re.match(r"^@(!?)(%\w+)\s+(.*)$", stmt)
        if m:
            pred = (m.group(1) == "!", m.group(2))
            stmt = m.group(3)
        parts = stmt.split(None, 1)
        op = parts[0]
        ops = _split_operands(parts[1]) if len(parts) > 1 else []
        return pred, op, ops


class CTA:
    def __init__(self, prog: Program, nthreads: int, params: dict, gmem: dict, smem_bytes=232448,
                 ctaid=(0, 0, 0)):
        self.p, self.n = prog, nthreads
        self.regs = [dict() for _ in range(nthreads)]
        self.params = params  # name -> int
        self.gmem = gmem  # base address -> bytearray (allocations)
        self.smem = bytearray(smem_bytes)
        self.ctaid = ctaid
        self.nctaid = (1, 1, 1)
        self.trace_ops = set()

    # --- memory -------------------------------------------------------------------------
    def _g(self, addr):
        for base, buf in self.gmem.items():
            if base <= addr < base + len(buf):
                return buf, addr - base
        raise IndexError(f"global address {addr:#x} outside every allocation")

    def mem_read(self, space, addr, nbytes):
        if space == "shared":
            return int.from_bytes(self.smem[addr:addr + nbytes], "little")
        buf, off = self._g(addr)
        if off + nbytes > len(buf):
            raise IndexError(f"global read past the end at {addr:#x}")
        return int.from_bytes(buf[off:off + nbytes], "little")

    def mem_write(self, space, addr, nbytes, value):
        data = (value & ((1 << (8 * nbytes)) - 1)).to_bytes(nbytes, "little")
        if space == "shared":
            if addr + nbytes > len(self.smem):
                raise IndexError("shared write out of range")
            self.smem[addr:addr + nbytes] = data
            return
        buf, off = self._g(addr)
        buf[off:off + nbytes] = data

    # --- operands -----------------------------------------------------------------------
    def val(self, t, s, bits=32):
        if s.startswith("%"):
            if s.startswith("%tid.x"):
                return t
            if s in ("%tid.y", "%tid.z"):
                return 0
            if s.startswith("%ctaid."):
                return self.ctaid["xyz".index(s[-1])]
            if s.startswith("%nctaid."):
                return self.nctaid["xyz".index(s[-1])]
            if s.startswith("%ntid."):
                return self.n if s.endswith("x") else 1
            if s == "%laneid":
                return t % 32
            # a register read before any write: LLVM's undef / poison operand of a prmt or a
            # select whose value is never used; 0 as on the hardware after launch is not
            # guaranteed, so code that depends on it would show up as a mismatch
            return self.regs[t].get(s, 0)
        if s == "global_smem":
            return 0
        if re.match(r"^0[fF][0-9a-fA-F]{8}$", s):
            return int(s[2:], 16)
        if s.endswith("U"):
            s = s[:-1]
        v = int(s, 0)
        return v & M[bits] if bits in M else v

    def addr(self, t, s):
        inner = s.strip()[1:-1].strip()
        m = re.match(r"^(\S+?)\s*(?:\+\s*(-?\w+))?$", inner)
        base = m.group(1)
        off = int(m.group(2), 0) if m.group(2) else 0
        if base in self.params:
            return base, off
        return self.val(t, base, 64) + off, None

    def set(self, t, reg, v, bits):
        self.regs[t][reg] = v & M[bits] if bits in M else v

    # --- execution ----------------------------------------------------------------------
    def run(self, max_steps=10_000_000):
        pc, steps, ins = 0, 0, self.p.instrs
        while pc < len(ins):
            steps += 1
            if steps > max_steps:
                raise RuntimeError("step limit")
            pred, op, ops = ins[pc]
            active = [t for t in range(self.n) if pred is None or bool(self.regs[t][pred[1]]) != pred[0]]
            base = op.split(".")[0]
            if base == "bra":
                if 0 < len(active) < self.n:
                    raise RuntimeError(f"divergent branch at {pc}: {op} {ops}")
                pc = self.p.labels[ops[0]] if active else pc + 1
                continue
            if base == "ret":
                break
            if base == "shfl":
                self._shfl(op, ops, active)
            elif base in ("ldmatrix", "stmatrix"):
                self._matrix(op, ops, active)
            elif base == "mma":
                self._mma(op, ops, active)
            else:
                for t in active:
                    self.step(t, op, ops)
            pc += 1
        return self

    def _shfl(self, op, ops, active):
        mode = op.split(".")[2]
        dst, src, b, c = ops[0], ops[1], ops[2], ops[3]
        assert c == "31" and (len(ops) < 5 or ops[4] == "-1"), f"only whole-warp shuffles: {op} {ops}"
        vals = [self.val(t, src) for t in range(self.n)]
        res = {}
        for t in active:
            lane = t % 32
            bb = self.val(t, b)
            if mode == "bfly":
                j = lane ^ bb
            elif mode == "idx":
                j = bb & 31
            elif mode == "up":
                j = lane - bb if lane - bb >= 0 else lane
            elif mode == "down":
                j = lane + bb if lane + bb < 32 else lane
            else:
                raise NotImplementedError(op)
            res[t] = vals[t - lane + j]
        for t, v in res.items():
            self.set(t, dst, v, 32)

    def _matrix(self, op, ops, active):
        """ldmatrix / stmatrix .m8n8 .x1/.x2/.x4 [.trans] .b16, per warp (all 32 lanes active)."""
        f = op.split(".")
        num = int(next(x for x in f if x in ("x1", "x2", "x4"))[1:])
        trans = "trans" in f
        load = f[0] == "ldmatrix"
        regs_s, addr_s = (ops[0], ops[1]) if load else (ops[1], ops[0])
        regs = _split_operands(regs_s.strip("{} "))
        assert len(regs) == num and len(active) == self.n, (op, len(active))
        for w0 in range(0, self.n, 32):
            rows = [self.addr(w0 + j, addr_s)[0] for j in range(32)]  # row address of matrix j // 8, row j % 8
            for t in range(w0, w0 + 32):
                lane = t - w0
                for i in range(num):
                    for k in range(2):
                        r, c = lane // 4, 2 * (lane % 4) + k  # fragment element (r, c) of matrix i
                        mr, mc = (c, r) if trans else (r, c)
                        a = rows[8 * i + mr] + 2 * mc
                        if load:
                            v = self.mem_read("shared", a, 2)
                            old = self.regs[t].get(regs[i], 0) if k else 0
                            self.regs[t][regs[i]] = (old & ~(0xFFFF << (16 * k))) | (v << (16 * k))
                        else:
                            self.mem_write("shared", a, 2, self.val(t, regs[i]) >> (16 * k))

    def _mma(self, op, ops, active):
        """mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 (or bf16), per warp."""
        f = op.split(".")
        assert "m16n8k16" in f and f[-4] == "row" and f[-3] == "col" or "m16n8k16" in f, op
        ab = f[-2]
        assert f[-1] == "f32" and ab in ("f16", "bf16"), op
        d, a, b, c = (_split_operands(x.strip("{} ")) for x in ops)
        assert len(active) == self.n
        half = _f16 if ab == "f16" else _bf16
        for w0 in range(0, self.n, 32):
            A = [[0.0] * 16 for _ in range(16)]
            B = [[0.0] * 8 for _ in range(16)]
            C = [[0.0] * 8 for _ in range(16)]
            for lane in range(32):
                t, g, q = w0 + lane, lane >> 2, lane & 3
                av = [self.val(t, x) for x in a]
                bv = [self.val(t, x) for x in b]
                cv = [_f32(self.val(t, x)) for x in c]
                for k in range(2):
                    A[g][2 * q + k] = half(av[0] >> (16 * k))
                    A[g + 8][2 * q + k] = half(av[1] >> (16 * k))
                    A[g][2 * q + 8 + k] = half(av[2] >> (16 * k))
                    A[g + 8][2 * q + 8 + k] = half(av[3] >> (16 * k))
                    B[2 * q + k][g] = half(bv[0] >> (16 * k))
                    B[2 * q + 8 + k][g] = half(bv[1] >> (16 * k))
                C[g][2 * q], C[g][2 * q + 1], C[g + 8][2 * q], C[g + 8][2 * q + 1] = cv
            D = [[C[i][j] + sum(A[i][k] * B[k][j] for k in range(16)) for j in range(8)] for i in range(16)]
            for lane in range(32):
                t, g, q = w0 + lane, lane >> 2, lane & 3
                for x, v in zip(d, (D[g][2 * q], D[g][2 * q + 1], D[g + 8][2 * q], D[g + 8][2 * q + 1])):
                    self.set(t, x, _from_f32(v), 32)

    def step(self, t, op, ops):  # noqa: C901 (one dispatcher)
        f = op.split(".")
        base, ty = f[0], f[-1]
        n = _bits(ty)
        V = lambda s, bits=n: self.val(t, s, bits)  # noqa: E731
        if base == "mov" and ops[1].startswith("{"):  # pack: the first element is the low part
            parts = _split_operands(ops[1].strip("{} "))
            w = n // len(parts)
            self.set(t, ops[0], sum((V(x, w) & M[w]) << (w * i) for i, x in enumerate(parts)), n)
        elif base == "mov" and ops[0].startswith("{"):  # unpack
            parts = _split_operands(ops[0].strip("{} "))
            w = n // len(parts)
            v = V(ops[1])
            for i, x in enumerate(parts):
                if x != "_":
                    self.set(t, x, v >> (w * i), w)
        elif base in ("mov", "cvta"):
            self.set(t, ops[0], V(ops[1]), n)
        elif base == "ld" and f[1] == "param":
            self.set(t, ops[0], self.params[self.addr(t, ops[1])[0]], n)
        elif base == "cp" and f[1] == "async" and f[2] in ("commit_group", "wait_group", "wait_all"):
            pass
        elif base == "cp" and f[1] == "async":
            dst, _ = self.addr(t, ops[0])
            src, _ = self.addr(t, ops[1])
            size = V(ops[2], 32)
            src_size = V(ops[3], 32) if len(ops) > 3 else size
            for i in range(size):
                self.mem_write("shared", dst + i, 1, self.mem_read("global", src + i, 1) if i < src_size else 0)
        elif base in ("ld", "st"):
            space = next(x for x in f if x in ("global", "shared", "local", "param"))
            vec = 1
            for x in f:
                if x.startswith("v") and x[1:].isdigit():
                    vec = int(x[1:])
            nb = max(n // 8, 1)
            a, _ = self.addr(t, ops[1] if base == "ld" else ops[0])
            regs = _split_operands((ops[0] if base == "ld" else ops[1]).strip("{} "))
            for i, r in enumerate(regs):
                if base == "ld":
                    self.set(t, r, self.mem_read(space, a + i * nb, nb), 32 if n < 32 and r.startswith("%r") else n)
                else:
                    self.mem_write(space, a + i * nb, nb, V(r, 64))
            assert len(regs) == vec, (op, ops)
        elif base == "add" and ty != "f32":
            self.set(t, ops[0], V(ops[1]) + V(ops[2]), n)
        elif base == "sub" and ty != "f32":
            self.set(t, ops[0], V(ops[1]) - V(ops[2]), n)
        elif base == "mul" and f[1] == "lo":
            self.set(t, ops[0], V(ops[1]) * V(ops[2]), n)
        elif base == "mul" and f[1] == "hi":
            a, b = V(ops[1]), V(ops[2])
            if ty.startswith("s"):
                a, b = _signed(a, n), _signed(b, n)
            self.set(t, ops[0], (a * b) >> n, n)
        elif base == "mul" and f[1] == "wide":
            a, b = V(ops[1]), V(ops[2])
            if ty.startswith("s"):
                a, b = _signed(a, n), _signed(b, n)
            self.set(t, ops[0], a * b, 2 * n)
        elif base == "mad" and f[1] == "lo":
            self.set(t, ops[0], V(ops[1]) * V(ops[2]) + V(ops[3]), n)
        elif base == "mad" and f[1] == "wide":
            a, b = V(ops[1]), V(ops[2])
            if ty.startswith("s"):
                a, b = _signed(a, n), _signed(b, n)
            self.set(t, ops[0], a * b + V(ops[3], 2 * n), 2 * n)
        elif base in ("and", "or", "xor") and ty == "pred":
            a, b = bool(V(ops[1])), bool(V(ops[2]))
            self.set(t, ops[0], int({"and": a and b, "or": a or b, "xor": a != b}[base]), 1)
        elif base == "and":
            self.set(t, ops[0], V(ops[1]) & V(ops[2]), n)
        elif base == "or":
            self.set(t, ops[0], V(ops[1]) | V(ops[2]), n)
        elif base == "xor":
            self.set(t, ops[0], V(ops[1]) ^ V(ops[2]), n)
        elif base in ("div", "rem") and ty != "f32":
            a, b = V(ops[1]), V(ops[2])
            if ty.startswith("s"):
                a, b = _signed(a, n), _signed(b, n)
                q = abs(a) // abs(b) * (1 if (a < 0) == (b < 0) else -1)  # truncation toward zero
                self.set(t, ops[0], q if base == "div" else a - q * b, n)
            else:
                self.set(t, ops[0], a // b if base == "div" else a % b, n)
        elif base == "bfi":  # insert a's low len bits into b at pos
            a, b, pos, ln = V(ops[1]), V(ops[2]), V(ops[3], 32) & 0xFF, V(ops[4], 32) & 0xFF
            m = ((1 << ln) - 1) << pos
            self.set(t, ops[0], (b & ~m) | ((a << pos) & m), n)
        elif base == "lop3":
            a, b, c, lut = V(ops[1]), V(ops[2]), V(ops[3]), V(ops[4])
            r = 0
            for bit in range(n):
                idx = (((a >> bit) & 1) << 2) | (((b >> bit) & 1) << 1) | ((c >> bit) & 1)
                r |= ((lut >> idx) & 1) << bit
            self.set(t, ops[0], r, n)
        elif base == "neg" and ty != "f32":
            self.set(t, ops[0], -V(ops[1]), n)
        elif base == "not":
            self.set(t, ops[0], (1 - V(ops[1])) if ty == "pred" else ~V(ops[1]), 1 if ty == "pred" else n)
        elif base == "shl":
            s = V(ops[2], 32)
            self.set(t, ops[0], V(ops[1]) << s if s < n else 0, n)
        elif base == "shr":
            s = min(V(ops[2], 32), n)
            a = V(ops[1])
            self.set(t, ops[0], (_signed(a, n) >> s) if ty.startswith("s") else (a >> s), n)
        elif base == "bfe":
            a, pos, ln = V(ops[1]), V(ops[2], 32) & 0xFF, V(ops[3], 32) & 0xFF
            x = (a >> pos) & ((1 << ln) - 1) if ln else 0
            if ty.startswith("s") and ln and (x >> (ln - 1)) & 1:
                x -= 1 << ln
            self.set(t, ops[0], x, n)
        elif base in ("min", "max") and ty != "f32":
            a, b = V(ops[1]), V(ops[2])
            if ty.startswith("s"):
                a, b = _signed(a, n), _signed(b, n)
            self.set(t, ops[0], min(a, b) if base == "min" else max(a, b), n)
        elif base == "setp":
            cmp, st = f[1], f[-1]
            a, b = V(ops[1], _bits(st)), V(ops[2], _bits(st))
            if st == "f32":
                a, b = _f32(a), _f32(b)
            elif st.startswith("s"):
                a, b = _signed(a, _bits(st)), _signed(b, _bits(st))
            r = {"lt": a < b, "le": a <= b, "gt": a > b, "ge": a >= b, "eq": a == b, "ne": a != b,
                 "lo": a < b, "ls": a <= b, "hi": a > b, "hs": a >= b}[cmp]
            self.set(t, ops[0], int(r), 1)
        elif base == "selp":
            self.set(t, ops[0], V(ops[1]) if self.regs[t][ops[3]] else V(ops[2]), n)
        elif base == "prmt":
            a, b, c = V(ops[1], 32), V(ops[2], 32), V(ops[3], 32)
            x = a | (b << 32)
            r = 0
            for i in range(4):
                s = (c >> (4 * i)) & 0xF
                byte = (x >> (8 * (s & 7))) & 0xFF
                if s & 8:  # sign replicate
                    byte = 0xFF if byte & 0x80 else 0
                r |= byte << (8 * i)
            self.set(t, ops[0], r, 32)
        elif base == "cvt":
            dt, st = f[-2], f[-1]
            if len(f) > 3 and f[1] in ("rn", "rz", "rm", "rp", "rni", "rzi"):
                dt, st = f[2], f[3]
            a = V(ops[1], _bits(st))
            if st.startswith("s") and not dt.startswith("f"):
                a = _signed(a, _bits(st))
            if dt == "f16x2" and st == "f32":  # d = {cvt(a) upper, cvt(b) lower}
                hi, lo = _to_f16(_f32(V(ops[1], 32))), _to_f16(_f32(V(ops[2], 32)))
                self.set(t, ops[0], (hi << 16) | lo, 32)
                return
            if dt == "f16" and st == "f32":
                self.set(t, ops[0], _to_f16(_f32(V(ops[1], 32))), 16)
                return
            if dt == "f32" and st in ("s32", "u32", "s64", "u64"):
                x = V(ops[1], _bits(st))
                if st.startswith("s"):
                    x = _signed(x, _bits(st))
                self.set(t, ops[0], _from_f32(float(x)), 32)
                return
            if dt in ("s32", "u32", "s64", "u64") and st == "f32":
                import math
                x = _f32(V(ops[1], 32))
                rnd = {"rni": round, "rzi": math.trunc, "rmi": math.floor, "rpi": math.ceil}
                mode = next((m for m in f if m in rnd), "rzi")
                self.set(t, ops[0], 0 if math.isnan(x) else int(rnd[mode](x)), _bits(dt))
                return
            if dt == "f32" and st == "f16":
                self.set(t, ops[0], _from_f32(_f16(V(ops[1], 16))), 32)
                return
            if dt.startswith("f") or st.startswith("f"):
                raise NotImplementedError(op)
            self.set(t, ops[0], a, _bits(dt))
        elif base == "bar" or base == "fence" or base == "membar":
            pass
        elif ty == "f32" and base in ("add", "sub", "mul", "fma", "max", "min", "neg", "abs", "div", "ex2", "lg2",
                                      "rcp", "sqrt", "rsqrt", "selp", "mov"):
            if base in ("selp", "mov"):
                raise AssertionError("unreachable")
            a = [_f32(V(o)) for o in ops[1:]]
            r = _fop(base, a)
            self.set(t, ops[0], _from_f32(r), 32)
        else:
            raise NotImplementedError(f"{op} {ops}")


def unsupported(ptx: str):
    prog = Program(ptx)
    ok = {"mov", "cvta", "ld", "st", "add", "sub", "mul", "mad", "and", "or", "xor", "not", "shl", "shr",
          "bfe", "min", "max", "setp", "selp", "prmt", "cvt", "bar", "fence", "membar", "bra", "ret", "shfl",
          "ldmatrix", "stmatrix", "mma", "cp", "neg", "fma", "div", "ex2", "rem", "lop3", "bfi", "abs", "lg2",
          "rcp", "sqrt", "rsqrt"}
    return sorted({op for _, op, _ in prog.instrs if op.split(".")[0] not in ok})


if __name__ == "__main__":
    print(unsupported(open(sys.argv[1]).read()) or "all opcodes supported")
