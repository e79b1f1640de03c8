"""Mutation testing of meshlm's core with mutmut: configuration and helpers (docs/mutation.md)."""
