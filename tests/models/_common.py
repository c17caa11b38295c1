"""Helpers shared by the tiny test models (functions only: no module classes are shared between models,
so a class-decorator tag on one model can never leak into another). They are the demo model's own
(cgcompile/examples/moe.py), so the tests and the demo build inputs and losses alike."""

from cgcompile.examples.moe import MAX_SEQ, VOCAB, lm_loss, seeded, token_inputs

__all__ = ["MAX_SEQ", "VOCAB", "lm_loss", "seeded", "token_inputs"]
