"""The CPU benchmarks' entry point: run as a plain script, relaunch this script under torchrun with
`nproc` ranks (OMP_NUM_THREADS=1 unless set: the ranks share the machine's cores); as a torchrun
worker, run `worker(args)`."""

import os
import subprocess
import sys


def main_or_worker(script: str, nproc: int, worker, args) -> None:
    if "LOCAL_RANK" in os.environ:
        worker(args)
        return
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={nproc}",
        os.path.abspath(script),
    ] + sys.argv[1:]
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(subprocess.call(cmd, env=env))
