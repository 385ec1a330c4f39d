"""A two-rank program for the failure test: rank 1 raises while rank 0 waits in a collective."""

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record

from nonstop.dist import init_process_group


@record
def main() -> None:
    info = init_process_group("cpu", timeout_s=30)
    if info.rank == 1:
        raise RuntimeError("injected failure on rank 1")
    dist.all_reduce(torch.ones(1))  # never completes: rank 1 is gone


if __name__ == "__main__":
    main()
