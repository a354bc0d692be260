"""matplotlib for the load-test reports: an optional extra, not a router dependency.

``pip install 'kvroute[loadtest]'`` installs it. Without it, importing a module that
plots raises ``ImportError`` with that instruction, so ``kvroute loadtest``/``sweep``/
``demo`` stop at once with one clear line instead of failing after a run.
"""

from __future__ import annotations

from types import ModuleType

MATPLOTLIB_MISSING = (
    "the load-test reports plot with matplotlib, an optional extra that is not installed: "
    "pip install 'kvroute[loadtest]'"
)


def import_pyplot() -> ModuleType:
    """``matplotlib.pyplot`` on the non-interactive Agg backend (no display needed)."""
    try:
        import matplotlib
    except ImportError as exc:
        raise ImportError(MATPLOTLIB_MISSING, name="matplotlib") from exc
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt
