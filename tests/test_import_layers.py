"""jaxserve's imports run one way: the layers contract in pyproject.toml holds, every part of the package is in it,
and no module imports itself back through others (lazy imports inside functions count too)."""

import pathlib
import sys
import tomllib

import grimp
from importlinter.cli import lint_imports

ROOT = pathlib.Path(__file__).resolve().parent.parent
PYPROJECT = ROOT / "pyproject.toml"


def contract_layers() -> list[str]:
    """The layers contract's names, each sibling on its own: ["__main__", "console", ...]."""
    config = tomllib.loads(PYPROJECT.read_text())["tool"]["importlinter"]
    (contract,) = [c for c in config["contracts"] if c["type"] == "layers"]
    return [name.strip() for layer in contract["layers"] for name in layer.split("|")]


def test_the_layers_contract_is_kept():
    assert lint_imports(config_filename=str(PYPROJECT), no_cache=True, no_logo=True) == 0


def test_every_module_and_package_of_jaxserve_is_in_a_layer():
    graph = grimp.build_graph("jaxserve")
    children = {name.removeprefix("jaxserve.") for name in graph.find_children("jaxserve")}
    layers = contract_layers()
    assert sorted(children - set(layers)) == [], "add the new module to [tool.importlinter] in pyproject.toml"
    assert sorted(set(layers) - children) == [], "a layer names a module that is gone"


def test_no_module_imports_itself_back():
    graph = grimp.build_graph("jaxserve")
    circles = [(module, imported, graph.find_shortest_chain(importer=imported, imported=module))
               for module in sorted(graph.modules)
               for imported in sorted(graph.find_modules_directly_imported_by(module))
               if graph.chain_exists(importer=imported, imported=module)]
    assert circles == []


def test_the_check_sees_an_upward_import_made_inside_a_function(tmp_path):
    package = tmp_path / "layered"
    (package / "low").mkdir(parents=True)
    (package / "high").mkdir()
    (package / "__init__.py").write_text("")
    (package / "high" / "__init__.py").write_text("from layered import low\n")
    (package / "low" / "__init__.py").write_text("def late():\n    from layered import high\n")
    config = tmp_path / "contract.toml"
    config.write_text('[tool.importlinter]\nroot_package = "layered"\n[[tool.importlinter.contracts]]\n'
                      'name = "one way"\ntype = "layers"\ncontainers = ["layered"]\nlayers = ["high", "low"]\n')
    sys.path.insert(0, str(tmp_path))
    try:
        assert lint_imports(config_filename=str(config), no_cache=True, no_logo=True) == 1
    finally:
        sys.path.remove(str(tmp_path))
