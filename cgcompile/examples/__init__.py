"""Tiny models shipped with the package, built in code (no downloads): `moe` is the demo's model
(`python -m cgcompile.demo`) and the tests' MoE (tests/models/moe.py)."""
