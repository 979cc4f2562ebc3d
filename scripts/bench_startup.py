"""Start-up cost of the drop-ins: Accelerate's `Accelerator()` + `prepare` and Lightning's
`Trainer.fit` up to the first batch (setup_distributed, our group, the model wrapped), with
nccl_ddp's classes against the frameworks' own (torch DDP on gloo), 2 CPU ranks.

    python scripts/bench_startup.py [--repeats 2] [--csv out/bench_startup.csv]

Each measurement is a fresh 2-rank job under nccl-ddp-run (imports, torch.distributed and our
group start from nothing); a rank's times are the slowest rank's. `job_s` is the whole job, launcher
start to exit, seen from here. Prints a table and writes a CSV.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from benchlib import format_table, write_csv  # noqa: E402

CASES = (("accelerate", "torch"), ("accelerate", "ours"), ("lightning", "torch"), ("lightning", "ours"))


def _model():
    import torch

    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 8))


def _slowest(values: dict) -> dict:
    import torch
    import torch.distributed as dist

    t = torch.tensor(list(values.values()), dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return dict(zip(values, t.tolist()))


def _accelerate(impl: str) -> dict:
    import torch

    if impl == "ours":
        from nccl_ddp.accelerate import Accelerator
    else:
        from accelerate import Accelerator
    t0 = time.perf_counter()
    acc = Accelerator(cpu=True)
    t1 = time.perf_counter()
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = acc.prepare(model, opt)
    t2 = time.perf_counter()
    out = _slowest({"init_s": t1 - t0, "prepare_s": t2 - t1, "total_s": t2 - t0})
    acc.end_training()
    return out


def _lightning(impl: str) -> dict:
    import lightning.pytorch as pl
    import torch

    marks: dict = {}

    class Net(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = _model()

        def training_step(self, batch, batch_idx):
            x, y = batch
            return torch.nn.functional.mse_loss(self.net(x), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

        def on_fit_start(self) -> None:
            marks["setup"] = time.perf_counter()

        def on_train_start(self) -> None:
            marks["train"] = time.perf_counter()

    if impl == "ours":
        from nccl_ddp.lightning import NcclDDPStrategy

        strategy = NcclDDPStrategy()
    else:
        strategy = "ddp"
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=strategy,
        max_steps=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    data = torch.utils.data.TensorDataset(torch.randn(16, 64), torch.randn(16, 8))
    t0 = time.perf_counter()
    trainer.fit(Net(), torch.utils.data.DataLoader(data, batch_size=4))
    t1 = time.perf_counter()
    return _slowest(
        {"init_s": marks["setup"] - t0, "prepare_s": marks["train"] - marks["setup"], "total_s": t1 - t0}
    )


def _worker(framework: str, impl: str, result: str) -> None:
    import torch

    torch.set_num_threads(1)
    out = _accelerate(impl) if framework == "accelerate" else _lightning(impl)
    if int(os.environ["RANK"]) == 0:
        with open(result, "w") as f:
            json.dump(out, f)
    import torch.distributed as dist

    if dist.is_initialized():  # gloo's threads abort a rank whose peer exited first
        dist.barrier()
        dist.destroy_process_group()


def _job(framework: str, impl: str, timeout: float) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        result = os.path.join(tmp, "result.json")
        cmd = [sys.executable, "-m", "nccl_ddp.launch", "--nproc-per-node", "2", os.path.abspath(__file__)]
        cmd += ["--worker", framework, impl, result]
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, timeout=timeout, env=env, capture_output=True, text=True)
        job = time.perf_counter() - t0
        if proc.returncode != 0:
            raise RuntimeError(f"{framework}/{impl} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
        with open(result) as f:
            return {**json.load(f), "job_s": job}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--timeout", type=float, default=600.0)
    p.add_argument("--csv", default="out/bench_startup.csv")
    p.add_argument("--worker", nargs=3, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main() -> int:
    args = parse_args()
    if args.worker:
        _worker(*args.worker)
        return 0
    rows = []
    for rep in range(args.repeats):
        for framework, impl in CASES:
            rows.append(
                {"framework": framework, "ddp": impl, "repeat": rep, **_job(framework, impl, args.timeout)}
            )
    cols = ["framework", "ddp", "repeat", "init_s", "prepare_s", "total_s", "job_s"]
    print(format_table(rows, cols, {c: ".2f" for c in cols[3:]}))
    write_csv(rows, args.csv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
