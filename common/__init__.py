"""Shared core of splitserve: configuration, wire protocol, sequences, block pool and the engine.

Importing `common` (or any non-engine module in it) must not import torch; only `common.engine`
does.
"""
