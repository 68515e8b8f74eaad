#!/usr/bin/env python3
"""Fails if a source file imports a file that imports it (docs/architecture.md, "Import
rules"): in each Rust crate, through `crate::` paths outside comments and test modules; in the
Python package, through its own modules' imports. Prints each circle found."""
import ast
import os
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def rust_module_file(src: Path, parts: list[str]) -> Path | None:
    """The file that holds `crate::parts…` (its longest prefix that names a module file)."""
    for k in range(len(parts), 0, -1):
        base = src.joinpath(*parts[:k])
        for candidate in (base.with_suffix(".rs"), base / "mod.rs"):
            if candidate.is_file():
                return candidate
    return None


TEST_MODULE = re.compile(r"#\[cfg\((?:all\()?test[^\]]*\)\]\s*(?:pub(?:\(crate\))?\s+)?mod\s+\w+\s*\{")


def without_tests_and_comments(text: str) -> str:
    out, i = [], 0
    while (m := TEST_MODULE.search(text, i)) is not None:
        out.append(text[i : m.start()])
        j, depth = m.end(), 1
        while depth and j < len(text):
            depth += {"{": 1, "}": -1}.get(text[j], 0)
            j += 1
        i = j
    out.append(text[i:])
    return "\n".join(line for line in "".join(out).splitlines() if not line.lstrip().startswith("//"))


def rust_graph(src: Path) -> dict[Path, set[Path]]:
    graph = {}
    for f in src.rglob("*.rs"):
        text = without_tests_and_comments(f.read_text())
        deps = set()
        # `$crate::` is a macro's output path, resolved where the macro is used.
        for m in re.finditer(r"(?<!\$)\bcrate::((?:\w+::)*\w+)", text):
            target = rust_module_file(src, m.group(1).split("::"))
            if target is not None and target != f and target.name != "lib.rs":
                deps.add(target)
        graph[f] = deps
    return graph


def python_graph(package: Path) -> dict[Path, set[Path]]:
    graph = {}
    name = package.name
    for f in package.rglob("*.py"):
        tree = ast.parse(f.read_text())
        here = f.relative_to(package.parent).with_suffix("").parts
        pkg = here[:-1] if f.name != "__init__.py" else here[:-1]
        deps = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                base = list(pkg[: len(pkg) - node.level + 1]) if node.level else []
                mod = base + (node.module.split(".") if node.module else [])
                if not mod or mod[0] != name:
                    continue
                for alias in node.names:
                    for parts in (mod + [alias.name], mod):
                        target = package.parent.joinpath(*parts)
                        found = next((p for p in (target.with_suffix(".py"), target / "__init__.py") if p.is_file()), None)
                        if found is not None:
                            if found != f and found.name != "__init__.py":
                                deps.add(found)
                            break
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    parts = alias.name.split(".")
                    if parts[0] == name:
                        target = package.parent.joinpath(*parts)
                        for p in (target.with_suffix(".py"), target / "__init__.py"):
                            if p.is_file() and p != f and p.name != "__init__.py":
                                deps.add(p)
        graph[f] = deps
    return graph


def circles(graph: dict[Path, set[Path]]) -> list[tuple[Path, Path]]:
    return sorted((a, b) for a, deps in graph.items() for b in deps if a in graph.get(b, ()) and str(a) < str(b))


def main() -> int:
    found = []
    for manifest in ROOT.rglob("Cargo.toml"):
        if any(part in ("target", ".venv") or part.startswith(".") for part in manifest.relative_to(ROOT).parts[:-1]):
            continue
        src = manifest.parent / "src"
        if src.is_dir():
            found += circles(rust_graph(src))
    found += circles(python_graph(ROOT / "bindings/python/python/kt_kernel"))
    for a, b in found:
        print(f"import circle: {a.relative_to(ROOT)} <-> {b.relative_to(ROOT)}")
    print(f"{len(found)} import circles")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
