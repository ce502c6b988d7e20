"""cadence-example-backend: the plugin module named by the ``cadence.backends`` entry point.

cadence imports this module whenever it loads plugins (``engine backends``, every engine
start, every worker process), so it imports nothing heavy: no torch, not even the backend
class until cadence asks for it.
"""

from __future__ import annotations

from collections.abc import Callable

from cadence.hookspecs import hookimpl

__version__ = "0.1.0"


@hookimpl
def cadence_register_backends(register: Callable[[type], None]) -> None:
    # Importing backend.py is cheap: it imports torch only inside its methods.
    from cadence_example_backend.backend import ExampleBackend

    register(ExampleBackend)
