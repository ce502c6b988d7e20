"""Embeddings: a prompt's final hidden states pooled into one vector (vLLM's pooling runner,
``LLM.embed`` and ``/v1/embeddings``).

The data flow, from request to vector:

- ``params.PoolingParams`` is what a request asks (dimensions, normalization); the engine
  turns it into a one-token greedy request carrying a ``state.PoolingState``.
- ``config.PoolerConfig`` is how the model pools (last token, mean, first token; whether to
  normalize), read from the model folder's sentence-transformers files or the command line.
- Each step that computes prompt tokens of such a request asks the backend for the sums of
  the final hidden states over spans of its token rows (``ModelInput.pool_rows``); the
  forward computes them on the device (``cadence.layers.pooling``).
- ``state.PoolingState`` adds the spans up on the host as the chunks of a prompt arrive,
  and turns them into the embedding once the prompt is complete; the request's one sampled
  token is dropped.
"""

from cadence.pooling.config import POOLING_TYPES, PoolerConfig, load_pooler_config
from cadence.pooling.params import PoolingParams
from cadence.pooling.state import PoolingState

__all__ = ["POOLING_TYPES", "PoolerConfig", "PoolingParams", "PoolingState",
           "load_pooler_config"]
