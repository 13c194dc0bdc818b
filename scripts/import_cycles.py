"""List the import cycles among gateway/ modules (strongly connected components of size > 1).

Prints each cycle's modules, one component a line; exits 1 when any exists, 0 when none.
Uses grimp (installed by import-linter), so it sees the same import graph as `lint-imports`.
Usage: .venv/bin/python scripts/import_cycles.py [--runtime] [package]   (default: gateway)
``--runtime`` leaves out imports under ``if TYPE_CHECKING:`` (annotation-only edges), so what it
lists are the cycles Python meets when it imports the modules.
"""

from __future__ import annotations

import sys

import grimp


def strongly_connected(graph: grimp.ImportGraph, modules: set[str]) -> list[list[str]]:
    """Tarjan's algorithm (iterative) over the direct imports restricted to `modules`."""
    edges = {m: sorted(graph.find_modules_directly_imported_by(m) & modules) for m in modules}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    found: list[list[str]] = []
    counter = 0
    for root in sorted(modules):
        if root in index:
            continue
        work = [(root, 0)]
        while work:
            node, child = work.pop()
            if child == 0:
                index[node] = low[node] = counter
                counter += 1
                stack.append(node)
                on_stack.add(node)
            recurse = False
            for i in range(child, len(edges[node])):
                nxt = edges[node][i]
                if nxt not in index:
                    work.append((node, i + 1))
                    work.append((nxt, 0))
                    recurse = True
                    break
                if nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
            if recurse:
                continue
            if low[node] == index[node]:
                component = []
                while True:
                    top = stack.pop()
                    on_stack.discard(top)
                    component.append(top)
                    if top == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
    return sorted(found)


def main(argv: list[str]) -> int:
    args = [a for a in argv[1:] if a != "--runtime"]
    runtime = len(args) != len(argv) - 1
    package = args[0] if args else "gateway"
    graph = grimp.build_graph(package, cache_dir=None, exclude_type_checking_imports=runtime)
    cycles = strongly_connected(graph, set(graph.modules))
    for component in cycles:
        print(f"cycle ({len(component)} modules): " + " <-> ".join(component))
    kind = "runtime import cycle(s)" if runtime else "import cycle(s), annotation-only imports included,"
    print(f"{len(cycles)} {kind} among {package} modules")
    return 1 if cycles else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
