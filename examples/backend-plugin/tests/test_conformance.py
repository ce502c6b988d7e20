"""Run cadence's backend conformance kit against this package's backend.

``pytest`` here checks the ``example`` backend (``cadence_backend`` in pyproject.toml);
``pytest --cadence-backend NAME`` checks another one.
"""

from cadence.testing.conformance import *  # noqa: F403 (the kit's checks, collected here)
