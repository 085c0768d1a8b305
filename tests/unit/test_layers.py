"""The house's rules that a grep can keep: no module of the package imports another module's
private name (a leading underscore), so that each layer is used through what it documents."""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "hvd_compress"


def private_imports(path: Path):
    """(line, module, name) of each ``from hvd_compress... import _name`` in ``path``, relative
    imports included."""
    tree = ast.parse(path.read_text(), str(path))
    for node in ast.walk(tree):
        if not isinstance(node, ast.ImportFrom):
            continue
        internal = node.level > 0 or (node.module or "").split(".")[0] == "hvd_compress"
        for alias in node.names:
            if internal and alias.name.startswith("_") and not alias.name.startswith("__"):
                yield node.lineno, "." * node.level + (node.module or ""), alias.name


def test_no_module_imports_a_private_name_of_another():
    found = [
        f"{path.relative_to(PACKAGE.parent)}:{line}: from {module} import {name}"
        for path in sorted(PACKAGE.rglob("*.py"))
        for line, module, name in private_imports(path)
    ]
    assert not found, "private names imported across modules:\n" + "\n".join(found)


def test_the_check_sees_a_private_import(tmp_path):
    module = tmp_path / "m.py"
    module.write_text("from hvd_compress.integration.names import _hidden\nfrom .rounds import _x, visible\n")
    assert [name for _, _, name in private_imports(module)] == ["_hidden", "_x"]
