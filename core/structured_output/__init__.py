"""Structured output: constrain a request's tokens to a JSON schema, a regex, a choice or an
EBNF grammar, through xgrammar (docs/structured_output.md).

``params`` and ``bitmask`` import nothing heavy; ``compiler`` imports xgrammar (and torch)
only when a request first asks for structured output.
"""

from cadence.structured_output.bitmask import GrammarBitmask
from cadence.structured_output.params import StructuredOutputsParams

__all__ = ["GrammarBitmask", "StructuredOutputsParams"]
