"""One rank of a bare torchrun launch: join the gloo group, one barrier, leave."""

import torch.distributed as dist

dist.init_process_group("gloo")
dist.barrier()
dist.destroy_process_group()
