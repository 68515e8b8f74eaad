#!/usr/bin/env python3
"""Markdown tables from `kt bench --json` runs, for docs/performance.md and the README.

    python3 scripts/perf-table.py RUN.json [RUN.json ...]            # one table per preset
    python3 scripts/perf-table.py --medians RUN.json [RUN.json ...]  # the same, each cell "best / median"
    python3 scripts/perf-table.py --summary RUN.json [RUN.json ...]  # the README's short table
    python3 scripts/perf-table.py --compare B1.json B2.json -- A1.json A2.json  # before/after, best of alternated runs

Each case: best time in ms, and the ratio to the roofline the same run measured: weight bytes
per second / DRAM bandwidth for up to 4 tokens (decode), achieved rate / the peak of the
kernel's instruction family for more tokens (prefill, `*` where that family is VNNI, `†` vdpbf16ps;
512-bit FMA and int8 peaks for the AVX-512 backends). Decode cells of runs that have it add
`s` and the case's `stream_ratio` (the median over its reps of the time the pool took to stream
the rep's weight bytes right after it, over the rep's time). Runs of several backends give one
row per method and backend.
"""

import json
import statistics
import sys
from collections import defaultdict


def load(paths):
    return [json.load(open(p)) for p in paths]


def ratio(r):
    return r["dram_ratio"] if r["tokens"] <= 4 else r["compute_ratio"]


def cell(r):
    judged = r.get("judged_by") or ("vnni" if r.get("vnni") else "")
    mark = {"vnni": "*", "bf16dot": "†"}.get(judged, "") if r["tokens"] > 4 else ""
    stream = r.get("stream_ratio")
    paired = f", s{stream:.2f}" if stream is not None and r["tokens"] <= 4 else ""
    return f"{r['ms_best']:.2f} ({ratio(r):.2f}{mark}{paired})"


def median_cell(rs):
    """Best of the runs' best times and its ratio, then the median of the runs' median times (on
    a noisy VM the best alone flatters)."""
    best = min(rs, key=lambda r: r["ms_best"])
    return f"{cell(best)} / {statistics.median(r['ms_median'] for r in rs):.2f}"


def machine(runs):
    m = runs[0]["machine"]

    def span(key, fmt):
        vals = [r["roofline"][key] for r in runs if r["roofline"].get(key)]
        if not vals:
            return None
        lo, hi = min(vals), max(vals)
        return format(lo, fmt) if lo == hi else f"{lo:{fmt}}-{hi:{fmt}}"

    extra = [
        (f"VNNI {{}} GOP/s", span("vnni_gops", ".0f")),
        (f"512-bit FMA {{}} GFLOP/s", span("fma512_gflops", ".0f")),
        (f"512-bit int8 {{}} GOP/s", span("int8_512_gops", ".0f")),
        (f"vdpbf16ps {{}} GFLOP/s", span("bf16dot512_gflops", ".0f")),
    ]
    return (
        f"{m['cpu']}, {m['physical_cores']} cores, {m['numa_nodes']} NUMA node(s); best of {len(runs)} run(s), "
        f"rooflines measured by them: DRAM {span('dram_gbps', '.1f')} GB/s, FMA {span('fma_gflops', '.0f')} "
        f"GFLOP/s, int8 (AVX2) {span('int8_gops', '.0f')} GOP/s"
        + "".join(", " + label.format(v) for label, v in extra if v)
    )


def by_case(runs, short=False):
    """(preset, method, tokens) -> results of every run (`short`: "q4_K (down q5_0)" as q4_K).
    With several backends in the runs, the method is "method backend"."""
    backends = {r["backend"] for run in runs for r in run["results"]}
    cases = defaultdict(list)
    for run in runs:
        for r in run["results"]:
            method = r["method"].split(" (")[0] if short else r["method"]
            if len(backends) > 1:
                method += "\t" + r["backend"]
            cases[(r["preset"], method, r["tokens"])].append(r)
    return cases


def tables(runs, medians=False):
    cases = by_case(runs)
    tokens = sorted({t for (_, _, t) in cases})
    out = [machine(runs), ""]
    for preset in sorted({p for (p, _, _) in cases}):
        methods = list(dict.fromkeys(m for (p, m, _) in cases if p == preset))
        out += [f"**{preset}** (threads {cases[(preset, methods[0], tokens[0])][0]['threads']})", ""]
        out.append("| method | backend | " + " | ".join(f"n = {t}" for t in tokens) + " |")
        out.append("|---|---|" + "---|" * len(tokens))
        for m in methods:
            rs = [cases.get((preset, m, t), []) for t in tokens]
            backend = next(r[0]["backend"] for r in rs if r)
            name = m.split("\t")[0]
            show = median_cell if medians else lambda rs: cell(min(rs, key=lambda r: r["ms_best"]))
            out.append(f"| {name} | {backend} | " + " | ".join(show(r) if r else "" for r in rs) + " |")
        out.append("")
    return "\n".join(out)


def summary(runs):
    cases = by_case(runs, short=True)
    presets = sorted({p for (p, _, _) in cases})
    tokens = sorted({t for (_, _, t) in cases})
    head = [f"{p} n={t}" for p in presets for t in tokens]
    out = ["| method | " + " | ".join(head) + " |", "|---|" + "---|" * len(head)]
    methods = list(dict.fromkeys(m for (_, m, _) in cases))
    for m in methods:
        row = []
        for p in presets:
            for t in tokens:
                rs = cases.get((p, m, t), [])
                row.append(cell(min(rs, key=lambda r: r["ms_best"])) if rs else "")
        out.append(f"| {m.replace(chr(9), ' ')} | " + " | ".join(row) + " |")
    return "\n".join(out)


def compare(before, after):
    b, a = by_case(before), by_case(after)
    out = ["| preset | method | n | before ms (best of runs) | after ms | after / before |", "|---|---|---|---|---|---|"]
    for key in sorted(b, key=lambda k: (k[0], list(dict.fromkeys(m for (_, m, _) in b)).index(k[1]), k[2])):
        if key not in a:
            continue
        tb, ta = min(r["ms_best"] for r in b[key]), min(r["ms_best"] for r in a[key])
        out.append(f"| {key[0]} | {key[1]} | {key[2]} | {tb:.2f} | {ta:.2f} | {ta / tb:.2f} |")
    return "\n".join(out)


def main(argv):
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        return 0
    if argv[0] == "--medians":
        print(tables(load(argv[1:]), medians=True))
    elif argv[0] == "--summary":
        print(summary(load(argv[1:])))
    elif argv[0] == "--compare":
        half = [p for p in argv[1:]]
        if "--" in half:
            i = half.index("--")
            print(compare(load(half[:i]), load(half[i + 1:])))
        else:
            print(compare(load(half[:1]), load(half[1:2])))
    else:
        print(tables(load(argv)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
