"""Run under torch.distributed.run by tests/test_multi_node.py: each rank passes its own folder to
refuse_unshared_folder (argv: one folder per rank), as nodes whose job.dump_folder is local to each would see
one path; prints the refusal, or "shared", once per rank."""

from __future__ import annotations

import os
import sys

import torch.distributed as dist

from components.errors import UserError
from nsa_titan.parallel.start_agreement import refuse_unshared_folder

if __name__ == "__main__":
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    try:
        refuse_unshared_folder(sys.argv[1 + rank], is_main=rank == 0)
        said = "shared"
    except UserError as exc:
        said = str(exc)
    os.write(1, f"rank {rank}: {said}\n".encode())  # one write: the ranks share the pipe (print writes twice)
    dist.barrier()
    dist.destroy_process_group()
