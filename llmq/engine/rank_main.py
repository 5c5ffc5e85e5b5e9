"""A rank process of a parallel engine (started by ParallelGroup.launch): load this rank's shard,
then follow rank 0's steps until it says stop or goes away."""
from __future__ import annotations

import logging
import pickle
import sys

from llmq.engine.model_runner import ModelRunner
from llmq.engine.parallel_group import ParallelGroup, exit_with_parent


def main() -> None:
    launch = pickle.loads(sys.stdin.buffer.read())
    exit_with_parent(launch.parent_pid)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format=f"[%(asctime)s: %(levelname)s/rank {launch.rank} %(process)d] %(name)s: %(message)s")
    group = ParallelGroup.join(launch.config, launch.rank, launch.init_method)
    ModelRunner(launch.config, group).follow()
    group.close()


if __name__ == "__main__":
    main()
