# Copyright 2017 Uber Technologies, Inc. All Rights Reserved.
# Modifications copyright 2026 the nccl_ddp authors.
#
# Licensed under the Apache License, Version 2.0 (the "License");
# you may not use this file except in compliance with the License.
# You may obtain a copy of the License at
#
#     http://www.apache.org/licenses/LICENSE-2.0
#
# Unless required by applicable law or agreed to in writing, software
# distributed under the License is distributed on an "AS IS" BASIS,
# WITHOUT WARRANTIES OR CONDITIONS OF ANY KIND, either express or implied.
# See the License for the specific language governing permissions and
# limitations under the License.
# ==============================================================================
"""Horovod's examples/pytorch/pytorch_synthetic_benchmark.py on nccl_ddp: the Horovod import is
replaced by nccl_ddp.horovod.torch. The other changes, each marked `nccl_ddp:`, make it a test
that runs in seconds on a CPU: a tiny model when torchvision is absent, a configurable image size,
a seeded global batch of which each rank trains its slice (so 2 ranks equal one process on the
full batch), --base-lr, and --save-params. Run: horovodrun -np 2 python THIS --no-cuda.
"""

# ruff: noqa: E501, UP031  (Horovod's code as it is)
import argparse
import timeit

import numpy as np
import torch.backends.cudnn as cudnn
import torch.nn.functional as F
import torch.optim as optim
import torch.utils.data.distributed

import nccl_ddp.horovod.torch as hvd  # nccl_ddp: was `import horovod.torch as hvd`

try:  # nccl_ddp: torchvision's models when installed, else the tiny one below
    from torchvision import models
except ImportError:
    models = None


class tiny(torch.nn.Module):  # nccl_ddp: a model small enough for a CPU test  # noqa: N801
    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 4, 3)
        self.fc = torch.nn.Linear(4, 1000)

    def forward(self, x):
        return self.fc(F.adaptive_avg_pool2d(F.relu(self.conv(x)), 1).flatten(1))


# Benchmark settings
parser = argparse.ArgumentParser(
    description="PyTorch Synthetic Benchmark", formatter_class=argparse.ArgumentDefaultsHelpFormatter
)
parser.add_argument(
    "--fp16-allreduce", action="store_true", default=False, help="use fp16 compression during allreduce"
)
parser.add_argument("--model", type=str, default="resnet50", help="model to benchmark")
parser.add_argument("--batch-size", type=int, default=32, help="input batch size")
parser.add_argument(
    "--num-warmup-batches",
    type=int,
    default=10,
    help="number of warm-up batches that don't count towards benchmark",
)
parser.add_argument(
    "--num-batches-per-iter", type=int, default=10, help="number of batches per benchmark iteration"
)
parser.add_argument("--num-iters", type=int, default=10, help="number of benchmark iterations")
parser.add_argument("--no-cuda", action="store_true", default=False, help="disables CUDA training")
parser.add_argument(
    "--use-adasum", action="store_true", default=False, help="use adasum algorithm to do reduction"
)
parser.add_argument("--image-size", type=int, default=224, help="nccl_ddp: image height and width")
parser.add_argument("--seed", type=int, default=0, help="nccl_ddp: seed of the model and the data")
parser.add_argument("--base-lr", type=float, default=0.01, help="nccl_ddp: the learning rate before scaling")
parser.add_argument(
    "--save-params", type=str, default="", help="nccl_ddp: rank 0 saves the parameters here (.npz)"
)

args = parser.parse_args()
args.cuda = not args.no_cuda and torch.cuda.is_available()

hvd.init()

if args.cuda:
    # Horovod: pin GPU to local rank.
    torch.cuda.set_device(hvd.local_rank())

cudnn.benchmark = True

# Set up standard model.
torch.manual_seed(args.seed)  # nccl_ddp: rank 0's initial model is the single-process run's
model = tiny() if args.model == "tiny" or models is None else getattr(models, args.model)()

# By default, Adasum doesn't need scaling up learning rate.
lr_scaler = hvd.size() if not args.use_adasum else 1

if args.cuda:
    # Move model to GPU.
    model.cuda()
    # If using GPU Adasum allreduce, scale learning rate by local_size.
    if args.use_adasum and hvd.nccl_built():
        lr_scaler = hvd.local_size()

optimizer = optim.SGD(model.parameters(), lr=args.base_lr * lr_scaler)

# Horovod: (optional) compression algorithm.
compression = hvd.Compression.fp16 if args.fp16_allreduce else hvd.Compression.none

# Horovod: wrap optimizer with DistributedOptimizer.
optimizer = hvd.DistributedOptimizer(
    optimizer,
    named_parameters=model.named_parameters(),
    compression=compression,
    op=hvd.Adasum if args.use_adasum else hvd.Average,
)

# Horovod: broadcast parameters & optimizer state.
hvd.broadcast_parameters(model.state_dict(), root_rank=0)
hvd.broadcast_optimizer_state(optimizer, root_rank=0)

# Set up fixed fake data
# nccl_ddp: one seeded global batch; this rank trains its slice
gen = torch.Generator().manual_seed(args.seed + 1)
n = args.batch_size * hvd.size()
mine = slice(hvd.rank() * args.batch_size, (hvd.rank() + 1) * args.batch_size)
data = torch.randn(n, 3, args.image_size, args.image_size, generator=gen)[mine]
target = (torch.LongTensor(n).random_(generator=gen) % 1000)[mine]
if args.cuda:
    data, target = data.cuda(), target.cuda()


def benchmark_step():
    optimizer.zero_grad()
    output = model(data)
    loss = F.cross_entropy(output, target)
    loss.backward()
    optimizer.step()


def log(s, nl=True):
    if hvd.rank() != 0:
        return
    print(s, end="\n" if nl else "")


log("Model: %s" % args.model)
log("Batch size: %d" % args.batch_size)
device = "GPU" if args.cuda else "CPU"
log("Number of %ss: %d" % (device, hvd.size()))

# Warm-up
log("Running warmup...")
timeit.timeit(benchmark_step, number=args.num_warmup_batches)

# Benchmark
log("Running benchmark...")
img_secs = []
for x in range(args.num_iters):
    time = timeit.timeit(benchmark_step, number=args.num_batches_per_iter)
    img_sec = args.batch_size * args.num_batches_per_iter / time
    log("Iter #%d: %.1f img/sec per %s" % (x, img_sec, device))
    img_secs.append(img_sec)

# Results
img_sec_mean = np.mean(img_secs)
img_sec_conf = 1.96 * np.std(img_secs)
log("Img/sec per %s: %.1f +-%.1f" % (device, img_sec_mean, img_sec_conf))
log(
    "Total img/sec on %d %s(s): %.1f +-%.1f"
    % (hvd.size(), device, hvd.size() * img_sec_mean, hvd.size() * img_sec_conf)
)
if args.save_params and hvd.rank() == 0:  # nccl_ddp: what the test compares
    np.savez(args.save_params, **{k: v.detach().cpu().numpy() for k, v in model.state_dict().items()})
