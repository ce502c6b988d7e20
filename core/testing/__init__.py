"""cadence.testing: the backend conformance kit for plugin authors.

``pytest_plugin`` (a pytest11 plugin: ``--cadence-backend NAME`` and the fixtures),
``conformance`` (the checks, as test functions), ``helpers`` (workloads and comparisons),
``tiny_model`` (a tiny random-weight Llama and tokenizer built locally). Importing this
package imports nothing heavy. See docs/writing_a_backend.md.
"""
