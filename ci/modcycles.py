#!/usr/bin/env python3
"""Fails if two modules of one crate import each other, directly or through others.

Every `crate::`, `super::` and `self::` path in a crate's non-test sources (use statements,
brace groups expanded, and paths in code) is an edge from the module that writes it to the
module that defines what the path names (re-exports followed). An edge between a module and its
own ancestor or descendant is the module tree itself (a parent re-exports, a child names its
parent's types) and is not counted; any other edge is lifted to the two sibling modules under
their common parent. A cycle among siblings is an error: the imports of a crate must run one way.

Usage: python3 ci/modcycles.py [CRATE_SRC_DIR ...]   (default: every crate of the workspace)
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

CRATES = ["src", "buckets/src", "schedule/src", "topo/src", "kernels/src"]
PATH = re.compile(r"\b(crate|super|self)((?:::\w+)+)")
USE = re.compile(r"\b(?:pub(?:\([^)]*\))?\s+)?use\s+([^;]+);", re.DOTALL)


def module_of(root: Path, file: Path) -> tuple[str, ...]:
    rel = file.relative_to(root).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] in ("lib", "main", "mod"):
        parts.pop()
    return tuple(parts)


def strip_tests(text: str) -> str:
    """Drops `#[cfg(test)] mod name { ... }` blocks and comments."""
    text = re.sub(r"//[^\n]*", "", text)
    out, i = [], 0
    for m in re.finditer(r"#\[cfg\(test\)\]\s*(?:pub(?:\([^)]*\))?\s+)?mod\s+\w+\s*\{", text):
        if m.start() < i:
            continue
        out.append(text[i : m.start()])
        depth, j = 1, m.end()
        while j < len(text) and depth:
            depth += {"{": 1, "}": -1}.get(text[j], 0)
            j += 1
        i = j
    out.append(text[i:])
    return "".join(out)


def expand(tree: str) -> list[str]:
    """`a::{b, c::{d, e}}` -> ["a::b", "a::c::d", "a::c::e"]."""
    tree = re.sub(r"\s+", "", tree)
    if "{" not in tree:
        return [tree]
    head, rest = tree.split("{", 1)
    body = rest[: rest.rfind("}")]
    items, depth, cur = [], 0, ""
    for ch in body:
        if ch == "," and depth == 0:
            items.append(cur)
            cur = ""
            continue
        depth += {"{": 1, "}": -1}.get(ch, 0)
        cur += ch
    items.append(cur)
    return [p for item in items if item for p in expand(head + item)]


def resolve(here: tuple[str, ...], path: str, is_mod_file: bool) -> tuple[str, ...] | None:
    parts = [p for p in path.split("::") if p]
    if not parts or parts[0] not in ("crate", "super", "self"):
        return None
    if parts[0] == "crate":
        base, parts = [], parts[1:]
    else:
        base = list(here)
        while parts and parts[0] in ("super", "self"):
            if parts.pop(0) == "super":
                if not base:
                    return None
                base.pop()
    return tuple(base + [p.split(" as ")[0] for p in parts if p != "self"])


PUB_USE = re.compile(r"\bpub(?:\([^)]*\))?\s+use\s+([^;]+);", re.DOTALL)


def reexports(root: Path, files: dict) -> dict:
    """Per module: the names it re-exports (`pub use a::b::Name;`), to where they resolve."""
    out: dict[tuple[str, ...], dict[str, tuple[str, ...]]] = {}
    for here, f in files.items():
        text = strip_tests(f.read_text())
        for m in PUB_USE.finditer(text):
            for p in expand(m.group(1)):
                p = p.replace(" ", "")
                name = p.split("::")[-1].split(" as ")[-1]
                if not p.startswith(("crate", "super", "self")):
                    p = "self::" + p
                target = resolve(here, p, False)
                if target is not None and name and name != "*":
                    out.setdefault(here, {})[name] = target
    return out


def locate(target: tuple[str, ...], mods: set, reexp: dict) -> tuple[str, ...]:
    """The module that defines what `target` names, following re-exports."""
    for _ in range(16):
        mod = target
        while mod and mod not in mods:
            mod = mod[:-1]
        rest = target[len(mod) :]
        if rest and rest[0] in reexp.get(mod, {}):
            nxt = reexp[mod][rest[0]] + rest[1:]
            if nxt == target:
                return mod
            target = nxt
            continue
        return mod
    return mod


def check(root: Path) -> list[str]:
    files = {module_of(root, f): f for f in root.rglob("*.rs")}
    mods = {m for m in files if not (m and m[-1] == "tests")}
    reexp = reexports(root, {m: files[m] for m in mods})
    edges: dict[tuple[str, ...], set[tuple[str, ...]]] = {}
    for here in mods:
        f = files[here]
        text = strip_tests(f.read_text())
        paths = [p for m in USE.finditer(text) for p in expand(m.group(1))]
        paths += [m.group(0) for m in PATH.finditer(USE.sub("", text))]
        for p in paths:
            target = resolve(here, p.replace(" ", ""), f.name in ("mod.rs", "lib.rs"))
            if target is None:
                continue
            target = locate(target, mods, reexp)
            n = 0
            while n < min(len(here), len(target)) and here[n] == target[n]:
                n += 1
            if n == len(here) or n == len(target):
                continue  # ancestor or descendant: the module tree itself
            edges.setdefault(here[: n + 1], set()).add(target[: n + 1])
    # Cycles among siblings: strongly connected components of more than one module.
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in edges.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                names = sorted("::".join(c) for c in comp)
                pairs = sorted(f"{'::'.join(a)} -> {'::'.join(b)}" for a in comp for b in edges.get(a, ()) if b in comp)
                out.append(f"{root}: cycle among {', '.join(names)} ({'; '.join(pairs)})")

    for v in list(edges):
        if v not in index:
            visit(v)
    return out


def main() -> int:
    top = Path(__file__).resolve().parent.parent
    roots = [Path(a) for a in sys.argv[1:]] or [top / c for c in CRATES]
    problems = [p for r in roots for p in check(r)]
    for p in problems:
        print(p)
    if problems:
        print("modcycles: imports between modules must run one way; move the shared piece down")
        return 1
    print(f"modcycles: no import cycles in {len(roots)} crates")
    return 0


if __name__ == "__main__":
    sys.exit(main())
