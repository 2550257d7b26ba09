"""`nsa-titan eval`: what a trained model does with its context (loss by position, a passkey probe)."""

from nsa_titan.evaluate.command import run_command

__all__ = ["run_command"]
