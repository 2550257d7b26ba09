"""`nsa-titan doctor`: preflight checks for a recipe on this machine, one line each (ok / warn / fail).

    run_checks(argv, world_size) -> list[Check]   versions, devices, recipe, data, dump folder, resume,
                                                  NSA backend on this device, memory estimate
    run_command(argv) -> int                      print them; exit 1 when any check fails
"""

from nsa_titan.doctor.checks import Check
from nsa_titan.doctor.command import run_checks, run_command

__all__ = ["Check", "run_checks", "run_command"]
