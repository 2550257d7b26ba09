"""nsa_titan: the training engine. It assembles the parts a recipe names and runs them."""

__version__ = "0.1.0"
