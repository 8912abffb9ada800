"""Optional dependencies (the install extras): checked before a command does any work, so that a missing one
is one line naming the package and the extra that brings it, not a traceback after minutes of computing."""

from __future__ import annotations

import importlib

EXTRAS = {"pyarrow": "trace", "duckdb": "trace", "matplotlib": "plot"}  # module -> the extra that installs it


class MissingExtra(ImportError):
    """An optional dependency a command needs is not installed (an ImportError, as the import would raise)."""


def require(what: str, *modules: str) -> None:
    """Import each module, or raise MissingExtra naming `what` needs it and how to install it."""
    missing = []
    for module in modules:
        try:
            importlib.import_module(module)
        except ImportError:
            missing.append(module)
    if missing:
        extras = sorted({EXTRAS[m] for m in missing})
        raise MissingExtra(
            f"{what} needs {', '.join(missing)}, which is not installed: pip install "
            + " ".join(f"'.[{e}]'" for e in extras)
            + " from moelens's checkout"
        )
