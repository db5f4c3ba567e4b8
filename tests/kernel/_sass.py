"""What a straight-line SASS function stores, as an expression graph, so that two compilers' machine code for the
same formula can be compared without a GPU (tests/kernel/test_triton_ptx.py).

Each register holds a node of a shared graph: equal computations get the same node id, whatever the registers,
the schedule or how constants are materialised (MOV, IMAD.MOV, HFMA2.MMA halves, immediates). Every floating-point
operation with its modifiers (.SAT, .RM, operand |x| and -x) is a node; products and sums are compared up to the
order of their operands (and the sign of a product up to which factor carries the minus: both exact). Predicated
instructions and FSEL are selects; `normalize` lifts every select to the top, so a computation that selects
coefficients before a polynomial (nvcc's erff) equals one that evaluates both polynomials and selects the result
(the erf PTX in runtime/gelu_math.py) exactly when each side of the predicate computes the same operations on the same values.
"""

from __future__ import annotations

import re
import struct
import subprocess

_REG = re.compile(r"^(UR\d+|R\d+|UP\d+|P\d+|RZ|URZ|PT)$")
_FLOAT_OPS = ("FMUL", "FADD", "FFMA", "FSEL", "FSETP", "MUFU", "FMNMX")
_LEAVES = ("const", "undef", "cbank", "sym", "true")


class Graph:
    def __init__(self):
        self._ids: dict = {}
        self.nodes: list = []

    def mk(self, *key) -> int:
        i = self._ids.get(key)
        if i is None:
            i = self._ids[key] = len(self.nodes)
            self.nodes.append(key)
        return i

    def op(self, i: int) -> str:
        return self.nodes[i][0]

    def args(self, i: int) -> tuple:
        return self.nodes[i][1:]

    def show(self, i: int, depth: int = 8) -> str:
        n = self.nodes[i]
        if n[0] == "const":
            return repr(struct.unpack("<f", struct.pack("<I", n[1]))[0])
        if depth == 0:
            return "..."
        return n[0] + "(" + ", ".join(self.show(a, depth - 1) if _is_node(a) else repr(a) for a in n[1:]) + ")"


def _is_node(a) -> bool:
    return isinstance(a, int) and not isinstance(a, bool)


def functions(cuobjdump: str, cubin) -> dict[str, list[str]]:
    """{function name: its instructions} from `cuobjdump -sass`."""
    text = subprocess.run([cuobjdump, "-sass", str(cubin)], check=True, capture_output=True, text=True).stdout
    out: dict[str, list[str]] = {}
    cur = None
    for line in text.splitlines():
        m = re.search(r"Function : (\S+)", line)
        if m:
            cur = out.setdefault(m.group(1), [])
            continue
        m = re.match(r"\s+/\*[0-9a-f]{4}\*/\s+(.*?)\s*;", line)
        if m and cur is not None:
            cur.append(re.sub(r"\s+", " ", m.group(1)))
    return out


def _split_operands(text: str) -> list[str]:
    out, depth, cur = [], 0, ""
    for ch in text:
        depth += (ch == "[") - (ch == "]")
        if ch == "," and depth == 0:
            out.append(cur.strip())
            cur = ""
        else:
            cur += ch
    if cur.strip():
        out.append(cur.strip())
    return out


def _float_bits(t: str):
    if re.fullmatch(r"-?0x[0-9a-f]+", t):
        return int(t, 16) & 0xFFFFFFFF
    if re.fullmatch(r"[-+]?(\d+\.?\d*(e[-+]?\d+)?|inf|nan)", t, re.I):
        return struct.unpack("<I", struct.pack("<f", float(t)))[0]
    return None


def canonical(g: Graph, op: str, args: list) -> int:
    """The node of op(args), FMUL/FFMA args being (product sign, a, b[, c])."""
    base = op.split(".")[0]
    if base in ("FMUL", "FFMA"):
        sign, ab = args[0], list(args[1:3])
        for k in (0, 1):
            if g.op(ab[k]) == "neg":
                sign = not sign
                ab[k] = g.args(ab[k])[0]
        return g.mk(op, sign, *sorted(ab), *args[3:])
    if base in ("FADD", "FMNMX"):
        return g.mk(op, *sorted(args[:2]), *args[2:])
    return g.mk(op, *args)


def evaluate(g: Graph, instrs: list[str]) -> dict:
    """{(address node, offset): stored node} of a straight-line function (EXIT/BRA/NOP ignored: predicated code
    only)."""
    regs = {"RZ": g.mk("const", 0), "URZ": g.mk("const", 0), "PT": g.mk("true")}
    stores: dict = {}

    def reg(name):
        if name not in regs:
            regs[name] = g.mk("undef", name)
        return regs[name]

    def fnorm(x):  # a float operand: constants' sign as neg(), neg(neg(x)) = x
        n = g.nodes[x]
        if n[0] == "const" and n[1] & 0x80000000:
            return g.mk("neg", g.mk("const", n[1] & 0x7FFFFFFF))
        if n[0] == "neg" and g.op(n[1]) == "neg":
            return g.args(n[1])[0]
        return x

    def operand(t):
        t = t.replace(".reuse", "")
        neg = t.startswith("-")
        t = t[1:] if neg else t
        notp = t.startswith("!")
        t = t[1:] if notp else t
        absolute = len(t) > 2 and t[0] == t[-1] == "|"
        t = t[1:-1] if absolute else t
        if _REG.match(t):
            v = reg(t)
        elif (b := _float_bits(("-" if neg else "") + t)) is not None:
            v, neg = g.mk("const", b), False
        elif t.startswith("c["):
            v = g.mk("cbank", t)
        else:
            v = g.mk("sym", t)
        if absolute:
            v = g.mk("abs", v)
        if neg:
            v = g.mk("neg", v)
        if notp:
            v = g.mk("not", v)
        return v

    def address(t):
        m = re.fullmatch(r"(?:desc\[\w+\])?\[(\w+)(?:\.64)?(?:\+(0x[0-9a-f]+))?\]", t)
        if m is None:
            raise ValueError(f"unexpected address {t!r}")
        return reg(m.group(1)), f"+{int(m.group(2) or '0', 16):#x}"

    for ins in instrs:
        pred = None
        m = re.match(r"@(!?)(P\d+|PT|UP\d+)\s+(.*)", ins)
        if m:
            pred, ins = (m.group(1) == "!", reg(m.group(2))), m.group(3)
        opcode, _, rest = ins.partition(" ")
        ops = _split_operands(rest)
        base = opcode.split(".")[0]
        if base in ("EXIT", "BRA", "NOP", "RET"):
            continue
        if base in ("STG", "ST"):
            stores[address(ops[0])] = operand(ops[1])
            continue
        ndst = 2 if ops and re.match(r"^!?(P\d+|PT)$", ops[0]) else 1  # FSETP/ISETP/LOP3 with predicate results
        dsts, srcs = ops[:ndst], ops[ndst:]
        if base == "LDG":
            val = g.mk(opcode, *address(srcs[0]))
        elif opcode in ("HFMA2.MMA", "HFMA2") and srcs[:2] == ["-RZ", "RZ"]:  # a 32-bit constant from two fp16 halves
            hi, lo = (struct.unpack("<H", struct.pack("<e", float(x)))[0] for x in srcs[2:4])
            val = g.mk("const", hi << 16 | lo)
        elif opcode in ("MOV", "IMAD.MOV.U32", "IMAD.MOV") and _float_bits(srcs[-1]) is not None:
            val = g.mk("const", _float_bits(srcs[-1]))
        elif base == "MOV":
            val = operand(srcs[0])
        elif opcode in ("IMAD.MOV.U32", "IMAD.MOV") and srcs[:2] == ["RZ", "RZ"]:  # a move through the IMAD unit
            val = operand(srcs[2])
        else:
            args = [operand(s) for s in srcs]
            if base in _FLOAT_OPS:
                args = [fnorm(a) for a in args]
            if base in ("FMUL", "FFMA"):
                val = canonical(g, opcode, [False] + args)
            elif base == "FSEL":
                a, b, p = args
                if g.op(p) == "not":
                    a, b, p = b, a, g.args(p)[0]
                val = g.mk("sel", p, a, b)
            else:
                val = canonical(g, opcode, args)
        for i, dst in enumerate(dsts):
            if dst in ("PT", "RZ", "URZ"):
                continue
            new = val if len(dsts) == 1 or i == 0 else g.mk("second", val)
            if pred is not None:
                negated, p = pred
                old = reg(dst)
                new = g.mk("sel", p, old, new) if negated else g.mk("sel", p, new, old)
            regs[dst] = new
    return stores


def normalize(g: Graph, x: int, env: frozenset = frozenset(), memo: dict | None = None) -> int:
    """x with every select lifted to the top: sel(p, a, b) where, inside a and b, p is known true / false.
    Exact for pure operations: op(sel(p, a, b), c) = sel(p, op(a, c), op(b, c))."""
    memo = {} if memo is None else memo
    key = (x, env)
    if key in memo:
        return memo[key]
    n = g.nodes[x]
    if n[0] == "sel":
        p, a, b = n[1:]
        if (p, True) in env:
            r = normalize(g, a, env, memo)
        elif (p, False) in env:
            r = normalize(g, b, env, memo)
        else:
            t = normalize(g, a, env | {(p, True)}, memo)
            f = normalize(g, b, env | {(p, False)}, memo)
            r = t if t == f else g.mk("sel", p, t, f)
    elif n[0] in _LEAVES:
        r = x
    else:
        args = [normalize(g, a, env, memo) if _is_node(a) else a for a in n[1:]]
        r = None
        for i, a in enumerate(args):
            if _is_node(a) and g.op(a) == "sel":
                p, ta, fb = g.args(a)
                t = normalize(g, canonical(g, n[0], args[:i] + [ta] + args[i + 1:]), env | {(p, True)}, memo)
                f = normalize(g, canonical(g, n[0], args[:i] + [fb] + args[i + 1:]), env | {(p, False)}, memo)
                r = t if t == f else g.mk("sel", p, t, f)
                break
        if r is None:
            r = canonical(g, n[0], args)
    memo[key] = r
    return r


def stored_value(g: Graph, instrs: list[str]) -> tuple:
    """(address, normalized node) of the one value a function stores."""
    stores = evaluate(g, instrs)
    if len(stores) != 1:
        raise AssertionError(f"expected one store, found {len(stores)}")
    ((address, value),) = stores.items()
    return address, normalize(g, value)


def first_difference(g: Graph, a: int, b: int, depth: int = 4) -> str:
    """Where two nodes first differ (descending while they have the same operation and arity), for messages."""
    while a != b:
        na, nb = g.nodes[a], g.nodes[b]
        if na[0] != nb[0] or len(na) != len(nb) or na[0] in _LEAVES:
            break
        diffs = [(x, y) for x, y in zip(na[1:], nb[1:]) if x != y]
        if len(diffs) != 1 or not (_is_node(diffs[0][0]) and _is_node(diffs[0][1])):
            break
        a, b = diffs[0]
    return f"{g.show(a, depth)}\n  vs  {g.show(b, depth)}"
