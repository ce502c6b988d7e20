"""Run cadence's backend conformance kit against this package's backend.

``pytest`` here checks the ``example`` backend (``cadence_backend`` in pyproject.toml);
``pytest --cadence-backend NAME`` checks another one.
"""

# Every check of the kit; pytest reports them as cadence/testing/conformance.py::test_...[example].
from cadence.testing.conformance import *
