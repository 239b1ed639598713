"""Report optmem's internal import graph: circles and wrong-way imports.

Uses ``grimp`` (installed with import-linter) to build the graph, lazy imports inside
functions included, and ``networkx`` to find strongly connected components.  Exit
status 1 when the package graph has a circle.

Usage: ``python tools/import_graph.py [--modules]`` (``--modules`` also prints module-level
cycles, i.e. circles between single modules rather than between packages).
"""

from __future__ import annotations

import sys

import grimp
import networkx as nx


def _unit(module: str) -> str:
    """Collapse a module to its layer unit: a subpackage of optmem, or a top-level module."""
    parts = module.split(".")
    return ".".join(parts[:2])


def main(argv: list[str]) -> int:
    """Print circles in the optmem import graph; return 1 if any exists."""
    graph = grimp.build_graph("optmem", cache_dir=None)
    modules = sorted(graph.modules)
    mod_graph: nx.DiGraph = nx.DiGraph()
    unit_graph: nx.DiGraph = nx.DiGraph()
    for module in modules:
        for imported in graph.find_modules_directly_imported_by(module):
            if not imported.startswith("optmem"):
                continue
            mod_graph.add_edge(module, imported)
            a, b = _unit(module), _unit(imported)
            if a != b and a != "optmem" and b != "optmem":
                unit_graph.add_edge(a, b)
    bad = 0
    for comp in nx.strongly_connected_components(unit_graph):
        if len(comp) > 1:
            bad += 1
            print("package circle:", " <-> ".join(sorted(comp)))
            sub = unit_graph.subgraph(comp)
            for a, b in sorted(sub.edges):
                lines = [
                    f"{m} -> {i}"
                    for m in modules
                    if _unit(m) == a
                    for i in graph.find_modules_directly_imported_by(m)
                    if _unit(i) == b
                ]
                print(f"  {a} -> {b}: " + "; ".join(lines))
    mod_cycles = [c for c in nx.strongly_connected_components(mod_graph) if len(c) > 1]
    if "--modules" in argv:
        for comp in mod_cycles:
            print("module circle:", " <-> ".join(sorted(comp)))
    print(f"{len(modules)} modules, {mod_graph.number_of_edges()} internal imports, "
          f"{bad} package circles, {len(mod_cycles)} module circles")
    return 1 if bad or mod_cycles else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
