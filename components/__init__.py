"""The parts a recipe names: NSA attention, models, data, optimizers.

Nothing here knows about the training loop; the engine (nsa_titan) assembles these parts.
"""
