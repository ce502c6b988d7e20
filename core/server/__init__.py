"""The OpenAI-compatible HTTP server: ``engine serve`` or ``build_app(AsyncLLM, name)``.

Needs the ``server`` extra (fastapi, uvicorn, prometheus-client); nothing else in cadence imports this package.
"""
