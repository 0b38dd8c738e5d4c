"""The package's layers (docs/design.md §5): no module imports a layer above its own or another
group of its layer, and no import cycles (tools/import_graph.py reads the sources with ``ast``:
lazy imports inside functions count)."""
import importlib.util
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _tool():
    spec = importlib.util.spec_from_file_location("import_graph", os.path.join(ROOT, "tools", "import_graph.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_every_module_has_a_layer():
    g = _tool()
    graph = g.imports(g.modules())
    assert "ssa_flash.triton.forward" in graph and "ssa_flash.ops" in graph
    for m in graph:
        g.place(m)  # KeyError names a module missing from LAYERS


def test_no_arrow_against_the_layers():
    g = _tool()
    assert g.bad_arrows(g.imports(g.modules())) == []


def test_no_import_cycle():
    g = _tool()
    assert g.cycles(g.imports(g.modules())) == []


def test_the_tool_sees_a_cycle_and_an_upward_arrow():
    g = _tool()
    graph = {"ssa_flash.triton.launch": {"ssa_flash.ops"}, "ssa_flash.ops": {"ssa_flash.triton.launch"}}
    assert g.cycles(graph) == [["ssa_flash.ops", "ssa_flash.triton.launch"]]
    assert [(a, b) for a, b, _ in g.bad_arrows(graph)] == [("ssa_flash.triton.launch", "ssa_flash.ops")]
