"""state/ stores and reads; nothing in it may depend on the layers above or on the engine.

The import-linter contract says the same; this test also runs where import-linter is not installed
and sees function-level imports, which a lazy import would otherwise hide until it runs.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import elesium.state

STATE = Path(elesium.state.__file__).parent
ALLOWED = ("elesium.state", "elesium.errors", "elesium.config")


def _imports(path: Path) -> list[tuple[int, str]]:
    """Every module ``path`` imports, wherever the import statement is (module, function, class)."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.append((node.lineno, node.module))
        elif isinstance(node, ast.ImportFrom) and node.level:  # relative: resolve against elesium.state
            out.append((node.lineno, "elesium.state" + ("." + node.module if node.module else "")))
    return out


def test_state_imports_only_itself_and_the_base_modules() -> None:
    bad = [f"{path.name}:{line}: {module}"
           for path in sorted(STATE.glob("*.py"))
           for line, module in _imports(path)
           if (module == "elesium" or module.startswith("elesium."))
           and not any(module == a or module.startswith(a + ".") for a in ALLOWED)]
    assert bad == []


def test_importing_state_loads_no_engine_module() -> None:
    """What the static check cannot see: an import that another state module triggers indirectly."""
    code = ("import sys, elesium.state, elesium.state.calibrations, elesium.state.queue_worker, "
            "elesium.state.fenced; "
            "print(sorted(m for m in sys.modules if m.startswith(('elesium.inference', 'elesium.api', "
            "'elesium.graphs'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
