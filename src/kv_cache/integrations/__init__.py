"""Adapters that run kv_cache inside other engines (vLLM).

Each integration lives in its own subpackage, imports the library downward, and is imported by
nothing in the library. Importing this package imports no engine.
"""
