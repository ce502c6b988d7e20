"""Where cadence keeps what it builds once per machine.

One root for everything: ``$CADENCE_CACHE_DIR``, else ``$XDG_CACHE_HOME/cadence``, else
``~/.cache/cadence``. Under it, ``kernels/`` (compiled CPU kernels), ``tuning/`` (measured
per-CPU choices) and ``models/`` (GGUF conversions, the built-in default model). Moving the
root moves all three, so a user who points it at a larger disk or a shared volume gets one
folder to manage.
"""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir(*parts: str) -> Path:
    """``<root>/<parts...>``; nothing is created."""
    base = os.environ.get("CADENCE_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "cadence")
    return Path(base).joinpath(*parts)
