"""Write core/src/ggml/grids.rs: the lattice tables of ggml's i-quant types (iq1_s/iq1_m,
iq2_xxs, iq2_xs, iq2_s, iq3_xxs, iq3_s) as gguf-py holds them. The tables are part of the
formats (each grid index names 4 or 8 levels) and cannot be derived, so they are taken from
the ecosystem's own package rather than typed in. Each entry is stored as the indices of its
levels into the type's level map, 2 or 3 bits a level, and expanded at compile time.

    target/pyenv/bin/python scripts/gen_iq_grids.py   # after scripts/python.sh installed gguf
"""

import pathlib

import numpy as np
from gguf import quants

OUT = pathlib.Path(__file__).resolve().parent.parent / "core/src/ggml/grids.rs"
TABLES = [
    ("IQ2XXS", quants.IQ2_XXS, "iq2_xxs"),
    ("IQ2XS", quants.IQ2_XS, "iq2_xs"),
    ("IQ2S", quants.IQ2_S, "iq2_s"),
    ("IQ3XXS", quants.IQ3_XXS, "iq3_xxs"),
    ("IQ3S", quants.IQ3_S, "iq3_s"),
    ("IQ1S", quants.IQ1_S, "iq1_s and iq1_m"),
]


def packed(cls):
    """Each grid entry as one u16: level k's index into the map at bits `bits·k`."""
    cls.init_grid()
    grid = cls.grid.reshape(cls.grid_shape)
    levels = list(cls.grid_map)
    bits = 2 if len(levels) <= 4 else 3
    assert bits * grid.shape[1] <= 16
    words = []
    for row in grid:
        w = 0
        for k, v in enumerate(row):
            w |= levels.index(int(v)) << (bits * k)
        words.append(w)
    return levels, bits, words


def main():
    out = [
        "//! The lattices of ggml's i-quant types: a grid index names 8 (iq1, iq2) or 4 (iq3) levels.",
        "//! Written by `scripts/gen_iq_grids.py` from gguf-py's tables: do not edit. Each entry is",
        "//! stored as its levels' indices into the type's level map and expanded at compile time.",
        "",
        "/// Levels `map[(w >> bits·k) & mask]`, k < N, as N little-endian bytes.",
        "const fn expand<const M: usize, const N: usize>(words: &[u16; M], map: &[i8], bits: u32) -> [u64; M] {",
        "    let mut out = [0u64; M];",
        "    let mut i = 0;",
        "    while i < M {",
        "        let mut k = 0;",
        "        while k < N {",
        "            let at = (words[i] >> (bits * k as u32)) & ((1 << bits) - 1);",
        "            out[i] |= (map[at as usize] as u8 as u64) << (8 * k);",
        "            k += 1;",
        "        }",
        "        i += 1;",
        "    }",
        "    out",
        "}",
        "",
    ]
    for name, cls, types in TABLES:
        levels, bits, words = packed(cls)
        n = len(words)
        per = cls.grid_shape[1]
        rust_t = "u64" if per == 8 else "u32"
        if name == "IQ1S":
            # Stored times 8: iq1's values are 8·level ± 1 eighths.
            levels = [8 * v for v in levels]
            out.append(f"/// The {types} levels, times 8 (iq1's values are 8·level ± 1 eighths).")
        else:
            out.append(f"/// The {types} levels.")
        out.append(f"pub const {name}_LEVELS: [i8; {len(levels)}] = {levels};")
        if name == "IQ1S":
            out.append(f"/// The {types} grid: {n} entries of 8 of those levels.")
            out.append(f"pub static {name}_GRID8: [u64; {n}] = expand::<{n}, 8>(&{name}_PACKED, &{name}_LEVELS, {bits});")
        elif rust_t == "u64":
            out.append(f"/// The {types} grid: {n} entries of {per} of those levels.")
            out.append(f"pub static {name}_GRID: [u64; {n}] = expand::<{n}, 8>(&{name}_PACKED, &{name}_LEVELS, {bits});")
        else:
            out.append(f"/// The {types} grid: {n} entries of {per} of those levels.")
            out.append(f"pub static {name}_GRID: [u32; {n}] = narrow(&expand::<{n}, 4>(&{name}_PACKED, &{name}_LEVELS, {bits}));")
        out.append(f"/// Its entries as indices into those levels, {bits} bits each (column k at bit {bits}·k).")
        out.append(f"pub const {name}_PACKED: [u16; {n}] = [")
        for i in range(0, n, 12):
            out.append("    " + " ".join(f"0x{w:04x}," for w in words[i : i + 12]))
        out.append("];")
        out.append("")
    out += [
        "/// The low 32 bits of each entry (the 4-level grids).",
        "const fn narrow<const M: usize>(x: &[u64; M]) -> [u32; M] {",
        "    let mut out = [0u32; M];",
        "    let mut i = 0;",
        "    while i < M {",
        "        out[i] = x[i] as u32;",
        "        i += 1;",
        "    }",
        "    out",
        "}",
    ]
    OUT.write_text("\n".join(out) + "\n")
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
