"""The recipe: schema, TOML loading with composition, command-line overrides and checks."""

from nsa_titan.config.errors import Problem, RecipeError
from nsa_titan.config.resolve import ResolvedRecipe, resolve
from nsa_titan.config.schema import Recipe

__all__ = ["Problem", "Recipe", "RecipeError", "ResolvedRecipe", "resolve"]
