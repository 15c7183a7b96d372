#!/usr/bin/python3
"""The PyTorch workload of `cargo xtask bench`: the same small MLP as
tests/fixtures/torch_train.py (CPU, one thread, SGD), driven over stdin so
one process serves every interleaved condition (no import cost per sample).

Prints `ready <pid>` after a warm-up, then per stdin line:
  run MODE N   run N training steps and print
               `result MODE N <elapsed_ns> <first_step> <last_step> <exit_ns> <cpu_ns>`
               MODE: bare | prof (torch.profiler, CPU activity) |
                     prof_stack (the same with with_stack=True)
  site SITE N  call one of PyTorch's own probe sites N times in a tight
               loop (no training step) and print
               `result SITE N <elapsed_ns> 0 0 0 <cpu_ns>`:
               cs   record_function("Optimizer.step#Bench.step"), whose
                    name reaches c10::ivalue::ConstantString::create
                    (the step marker's site, as Optimizer.step hits it)
               bw   backward() of a one-element graph, one
                    torch::autograd::Engine::execute (the aux marker's site)
               elapsed_ns covers the N steps only (time.monotonic_ns);
               exit_ns is the profiler's own __exit__ (trace building);
               cpu_ns is the training thread's CPU time over the N steps
               (CLOCK_THREAD_CPUTIME_ID: immune to other processes holding
               the CPU, still counting uprobe traps taken in this thread).
  quit
Every step logs `step <i> <before_ns> <after_ns>` around optimizer.step()
to --log, like the fixtures, when given.
"""
import argparse
import os
import sys
import time


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--log")
    ap.add_argument("--warmup", type=int, default=200)
    args = ap.parse_args()

    import torch
    import torch.nn as nn

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))
    loss_fn = nn.CrossEntropyLoss()
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    batch = 32
    log = open(args.log, "w") if args.log else None
    step = [0]

    def one_step():
        step[0] += 1
        opt.zero_grad()
        xb, yb = torch.randn(batch, 64), torch.randint(0, 10, (batch,))
        loss = loss_fn(model(xb), yb)
        loss.backward()
        before = time.monotonic_ns()
        opt.step()
        after = time.monotonic_ns()
        if log:
            log.write(f"step {step[0]} {before} {after}\n")
            log.flush()

    for _ in range(args.warmup):
        one_step()
    print(f"ready {os.getpid()}", flush=True)

    for line in sys.stdin:
        parts = line.split()
        if not parts:
            continue
        if parts[0] == "quit":
            break
        if parts[0] == "site" and len(parts) == 3:
            site, n = parts[1], int(parts[2])
            if site == "cs":
                rf = torch.autograd.profiler.record_function

                def call():
                    with rf("Optimizer.step#Bench.step"):
                        pass
            elif site == "bw":
                x = torch.ones(1, requires_grad=True)

                def call():
                    (x * 2.0).backward()
            else:
                print(f"error bad site: {site}", flush=True)
                continue
            call()
            c0 = time.thread_time_ns()
            t0 = time.monotonic_ns()
            for _ in range(n):
                call()
            t1 = time.monotonic_ns()
            c1 = time.thread_time_ns()
            print(f"result {site} {n} {t1 - t0} 0 0 0 {c1 - c0}", flush=True)
            continue
        if parts[0] != "run" or len(parts) != 3:
            print(f"error bad command: {line.strip()}", flush=True)
            continue
        mode, n = parts[1], int(parts[2])
        first = step[0] + 1
        exit_ns = 0
        if mode == "bare":
            c0 = time.thread_time_ns()
            t0 = time.monotonic_ns()
            for _ in range(n):
                one_step()
            t1 = time.monotonic_ns()
            c1 = time.thread_time_ns()
        elif mode in ("prof", "prof_stack"):
            from torch.profiler import ProfilerActivity, profile
            p = profile(activities=[ProfilerActivity.CPU], with_stack=(mode == "prof_stack"))
            p.__enter__()
            c0 = time.thread_time_ns()
            t0 = time.monotonic_ns()
            for _ in range(n):
                one_step()
            t1 = time.monotonic_ns()
            c1 = time.thread_time_ns()
            p.__exit__(None, None, None)
            exit_ns = time.monotonic_ns() - t1
            del p
        else:
            print(f"error bad mode: {mode}", flush=True)
            continue
        print(f"result {mode} {n} {t1 - t0} {first} {step[0]} {exit_ns} {c1 - c0}", flush=True)
    if log:
        log.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
