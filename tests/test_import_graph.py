"""The package's floors: no import cycle between them, no package module imported late."""

import os
import textwrap

from cursor_rl.tools import import_graph

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _graph(root):
    return import_graph.floor_graph(import_graph.edges(root))


def test_the_floors_have_no_cycle():
    """Every import, at the top of a module or inside a function, points to a floor
    below the importer's; a failure names the cycle and the imports that close it."""
    graph = _graph(ROOT)
    cycle = import_graph.find_cycle(graph)
    assert cycle is None, "import cycle: " + import_graph.describe_cycle(cycle, graph)


def test_no_package_module_is_imported_inside_a_function():
    """Imports inside functions are for optional extras; a package module imported
    there (outside ``DEFERRED``'s reasoned entries) hides a dependency."""
    edges = import_graph.edges(ROOT)
    late = import_graph.undeclared_deferred(edges)
    assert not late, "imported inside a function:\n" + "\n".join(map(str, late))
    present = {(e.importer, e.imported) for e in edges if e.in_function}
    stale = sorted(set(import_graph.DEFERRED) - present)
    assert not stale, f"DEFERRED lists imports that no longer exist: {stale}"


def test_the_shared_vocabulary_is_the_bottom_floor():
    """``cursor_rl.chat`` (tokenizer, protocol, episode records) imports no other floor,
    so every floor that speaks it can do so without importing another one."""
    graph = _graph(ROOT)
    assert graph["chat"] == {}
    for user in ("data", "env", "tasks", "sampler", "rl", "eval"):
        assert "chat" in graph[user], user
    for low, high in (("eval", "rl"), ("data", "env"), ("data", "tasks")):
        assert high not in graph[low], f"{low} imports {high}: {graph[low][high][0]}"


def _write_package(root, files):
    for path, text in files.items():
        full = os.path.join(root, "cursor_rl", path)
        os.makedirs(os.path.dirname(full), exist_ok=True)
        with open(full, "w") as fh:
            fh.write(textwrap.dedent(text))


def test_a_cycle_closed_inside_a_function_is_found_and_named(tmp_path):
    """The checker itself: floor ``a`` imports ``b`` at its top, ``b`` imports ``a``
    back inside a function; a third floor imports both from a name."""
    _write_package(
        str(tmp_path),
        {
            "__init__.py": "",
            "a/__init__.py": "",
            "a/x.py": "from cursor_rl.b import y\n",
            "b/__init__.py": "",
            "b/y.py": """
                import os


                def late():
                    from cursor_rl.a import x

                    return x
            """,
            "top.py": "from cursor_rl.a import x\nimport cursor_rl.b.y\n",
        },
    )
    edges = import_graph.edges(str(tmp_path))
    graph = import_graph.floor_graph(edges)
    assert graph == {
        "a": {"b": graph["a"]["b"]},
        "b": {"a": graph["b"]["a"]},
        "top": {"a": graph["top"]["a"], "b": graph["top"]["b"]},
    }
    cycle = import_graph.find_cycle(graph)
    assert cycle == ["a", "b", "a"]
    message = import_graph.describe_cycle(cycle, graph)
    assert "cursor_rl/b/y.py:6 imports cursor_rl.a.x (inside a function)" in message
    assert [(e.importer, e.imported) for e in import_graph.undeclared_deferred(edges)] == [
        ("cursor_rl.b.y", "cursor_rl.a.x")
    ]
    del graph["b"]["a"]
    assert import_graph.find_cycle(graph) is None
    assert import_graph.stack(graph) == [["b"], ["a"], ["top"]]
