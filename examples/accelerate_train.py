"""Train a small MLP with Accelerate, as one gradientmail learner per launch.

Each launch trains its own copy on its own shard of a synthetic regression task (learn a
fixed random "teacher" network), and mails its changes to the run's mailbox; the learners
meet only there. Settings come from `GRADIENTMAIL_CONFIG` (see examples/diloco.yaml) and
`GRADIENTMAIL_*` variables:

    GRADIENTMAIL_CONFIG=examples/diloco.yaml accelerate launch --config_file CFG \\
        examples/accelerate_train.py
    # another machine (or terminal), the same run:
    GRADIENTMAIL_CONFIG=examples/diloco.yaml GRADIENTMAIL_LEARNER_ID=node-2 \\
        accelerate launch --config_file CFG examples/accelerate_train.py --data-seed 2
    # one learner of two CPU processes (accelerate launch runs a single CPU process):
    GRADIENTMAIL_CONFIG=examples/diloco.yaml torchrun --nproc_per_node 2 \\
        examples/accelerate_train.py --cpu

It prints the training loss, the held-out loss of the final model and the learner's
numbers (rounds, bytes, staleness, mean cosine); `--output` saves the final model.
"""

from __future__ import annotations

import argparse
import time

import torch
from accelerate import Accelerator
from torch.utils.data import DataLoader, TensorDataset

from gradientmail_accelerate import DiLoCo, DiLoCoPlugin

DIM = 32


def teacher_data(n: int, seed: int) -> TensorDataset:
    """`n` samples of y = teacher(x) + noise; the teacher is the same for every seed."""
    teacher = torch.nn.Sequential(torch.nn.Linear(DIM, 64), torch.nn.Tanh(), torch.nn.Linear(64, 4))
    with torch.random.fork_rng():
        torch.manual_seed(12345)
        for p in teacher.parameters():
            torch.nn.init.normal_(p, std=0.3)
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, DIM, generator=g)
    with torch.no_grad():
        y = teacher(x) + 0.01 * torch.randn(n, 4, generator=g)
    return TensorDataset(x, y)


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(DIM, 128),
        torch.nn.GELU(),
        torch.nn.Linear(128, 128),
        torch.nn.GELU(),
        torch.nn.Linear(128, 4),
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=300, help="optimizer steps")
    ap.add_argument("--batch-size", type=int, default=32, help="per process")
    ap.add_argument("--accum", type=int, default=1, help="gradient accumulation steps")
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--data-seed", type=int, default=1, help="this learner's data shard")
    ap.add_argument("--cpu", action="store_true", help="train on CPU even with a GPU")
    ap.add_argument("--wait-for", type=int, default=1, help="start once N learners are live")
    ap.add_argument("--log-every", type=int, default=50)
    ap.add_argument("--output", help="save the final model here (.safetensors)")
    args = ap.parse_args()

    accelerator = Accelerator(cpu=args.cpu, gradient_accumulation_steps=args.accum)
    model = make_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    samples = args.steps * args.batch_size * args.accum * accelerator.num_processes
    loader = DataLoader(
        teacher_data(samples, args.data_seed), batch_size=args.batch_size, shuffle=True
    )
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    held_out = teacher_data(1024, seed=10**6).tensors

    def held_out_loss() -> float:
        net = accelerator.unwrap_model(model)  # no DDP collectives: main process only
        with torch.no_grad():
            x, y = (t.to(accelerator.device) for t in held_out)
            return torch.nn.functional.mse_loss(net(x), y).item()

    before = held_out_loss()
    t0 = time.monotonic()
    with DiLoCo(accelerator, model, optimizer, DiLoCoPlugin.from_env()) as diloco:
        accelerator.print(
            f"learner {diloco.learner_id}: {accelerator.num_processes} process(es) on "
            f"{accelerator.device}, joined at round {diloco.rounds_seen}"
        )
        if args.wait_for > 1 and not diloco.wait_for_learners(args.wait_for):
            accelerator.print(f"fewer than {args.wait_for} learners came; training anyway")
        while diloco.optimizer_steps < args.steps:
            for x, y in loader:
                diloco.count(x.shape[0])  # weight this learner by the samples it saw
                with accelerator.accumulate(model):
                    loss = torch.nn.functional.mse_loss(model(x), y)
                    accelerator.backward(loss)
                    optimizer.step()
                    optimizer.zero_grad()
                step = diloco.optimizer_steps
                if accelerator.sync_gradients and step % args.log_every == 0:
                    accelerator.print(
                        f"step {step:5d}  loss {loss.item():.4f}  rounds {diloco.rounds_seen}"
                    )
                    accelerator.log(diloco.metrics(), step=step)
                if step >= args.steps:
                    break
        numbers = diloco.metrics()
    # Leaving the block waited for the rounds in flight and put the newest commits in.
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        net = accelerator.unwrap_model(model)
        print(
            f"held-out loss {before:.4f} -> {held_out_loss():.4f} after {args.steps} "
            f"steps, {time.monotonic() - t0:.1f}s"
        )
        print("  ".join(f"{k.split('/')[-1]}={v:g}" for k, v in sorted(numbers.items())))
        if args.output:
            from safetensors.torch import save_file

            save_file(
                {n: p.detach().cpu().contiguous() for n, p in net.named_parameters()}, args.output
            )
    # Accelerate's own advice: tear the process group down before exit (left to interpreter
    # shutdown, gloo's threads can abort a finished run).
    accelerator.end_training()


if __name__ == "__main__":
    main()
