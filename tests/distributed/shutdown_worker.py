"""One rank of test_shutdown: train a few steps with ep_size 2 through `run_training` (which
starts and shuts down the process group itself), then report this process's threads."""

import json
import os
import sys

import torch


def threads() -> list[str]:
    """The names of this process's OS threads (C++ ones included, which `threading` misses)."""
    tasks = "/proc/self/task"
    return sorted(open(f"{tasks}/{t}/comm").read().strip() for t in os.listdir(tasks))


def main(rank: int, port: int, out: str, config: str, *overrides: str) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE="2",
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    torch.ones(64, 64) @ torch.ones(64, 64)  # the intra-op pool exists before the baseline
    before = threads()
    from moe_train.commands import run_training
    from moe_train.config import load_config

    summary = run_training(load_config(config, list(overrides)), resume=False)
    with open(f"{out}.{rank}.json", "w") as f:
        json.dump({"before": before, "after": threads(), "step": summary["step"]}, f)


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), *sys.argv[3:])
