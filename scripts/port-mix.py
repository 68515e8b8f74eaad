#!/usr/bin/env python3
"""What a 512-bit instruction beside `vpdpbusd` costs on this CPU (docs/tuning.md).

Times a loop of 16 independent `vpdpbusd zmm` with 2, 4 or 8 other instructions added
(`vfmadd231ps`, `vmulps`, `vcvtdq2ps`, `vpaddd`, `vbroadcasti64x4` from memory) and prints
TSC ticks per iteration, best of 7 runs of 2M iterations, three rounds: an instruction that
shares `vpdpbusd`'s pipes adds about a `vpdpbusd`'s time, one that does not adds nothing.
The loop is inline assembly, so the compiler cannot reorder or drop it. Needs gcc and
AVX512-VNNI. Usage: python3 scripts/port-mix.py
"""
import os
import subprocess
import sys
import tempfile

OPS = {
    "vfmadd231ps": "vfmadd231ps %%zmm18, %%zmm19, %%zmm{r}",
    "vmulps": "vmulps %%zmm18, %%zmm{r}, %%zmm{r}",
    "vcvtdq2ps": "vcvtdq2ps %%zmm18, %%zmm{r}",
    "vpaddd": "vpaddd %%zmm18, %%zmm{r}, %%zmm{r}",
    "vbroadcasti64x4": "vbroadcasti64x4 (%%rsp), %%zmm{r}",
}
DOTS = "".join(f"vpdpbusd %%zmm16, %%zmm17, %%zmm{i}\\n\\t" for i in range(16))


def case(name, body):
    return (
        f"static double {name}(void) {{ uint64_t best = ~0ull; for (int r = 0; r < 7; r++) {{"
        f" uint64_t t0 = rd(); long it = 2000000;"
        f' __asm__ volatile("1:\\n\\t{body}dec %0\\n\\tjnz 1b" : "+r"(it) :: "memory");'
        f" uint64_t t = rd() - t0; if (t < best) best = t; }} return (double)best / 2000000; }}"
    )


def main():
    cases = [("none", 0, DOTS)]
    for op, text in OPS.items():
        for n in (2, 4, 8):
            extra = "".join(text.format(r=20 + j % 8) + "\\n\\t" for j in range(n))
            cases.append((op, n, DOTS + extra))
    src = ["#include <stdio.h>", "#include <stdint.h>", "#include <x86intrin.h>",
           "static inline uint64_t rd(void) { unsigned a; return __rdtscp(&a); }"]
    src += [case(f"c{i}", body) for i, (_, _, body) in enumerate(cases)]
    src.append("int main(void) {")
    src.append('  __asm__ volatile("vpxord %%zmm16,%%zmm16,%%zmm16\\n\\tvpxord %%zmm17,%%zmm17,%%zmm17\\n\\t'
               'vxorps %%zmm18,%%zmm18,%%zmm18\\n\\tvxorps %%zmm19,%%zmm19,%%zmm19" ::: "memory");')
    src.append("  for (int k = 0; k < 3; k++) {")
    src += [f'    printf("{op} {n} %.2f\\n", c{i}());' for i, (op, n, _) in enumerate(cases)]
    src += ["  }", "  return 0;", "}"]
    with tempfile.TemporaryDirectory() as d:
        c, exe = os.path.join(d, "mix.c"), os.path.join(d, "mix")
        with open(c, "w") as f:
            f.write("\n".join(src))
        subprocess.run(["gcc", "-O2", c, "-o", exe], check=True)
        out = subprocess.run([exe], check=True, capture_output=True, text=True).stdout
    rounds = {}
    for line in out.splitlines():
        op, n, t = line.split()
        rounds.setdefault((op, int(n)), []).append(float(t))
    base = min(rounds[("none", 0)])
    print("16 x vpdpbusd zmm plus | ticks per iteration (3 rounds) | best over the 16 alone")
    for (op, n), ts in rounds.items():
        label = "nothing" if op == "none" else f"{n} x {op}"
        print(f"{label:24} | {' '.join(f'{t:6.2f}' for t in ts)} | {min(ts) / base:.2f}")


if __name__ == "__main__":
    sys.exit(main())
