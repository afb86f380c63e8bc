"""rlkv.cpu_memory: freed blocks stay in the process, so a loop that allocates and frees the same
large tensor stops faulting in fresh pages (measured in a fresh process, before and after, per round)."""

import json
import platform
import subprocess
import sys

import pytest

from rlkv.cpu_memory import keep_freed_memory

PROBE = r"""
import json, resource, torch
from rlkv.cpu_memory import keep_freed_memory

def faults_per_round(rounds=8):
    # one count per round: a single heap growth (a small allocation landing in a freed hole once) is
    # one block's faults in one round, which a mean over the rounds would smear into every round
    # a sampling step's shape: the fp32 logits and the noise, both [32, 151936] (19 MiB), alive together
    logits = torch.ones(32, 151936, dtype=torch.bfloat16)

    def step():
        noise = torch.rand(logits.shape)
        return noise.add_(logits.float()).argmax(-1)

    step()
    counts = []
    for _ in range(rounds):
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        step()
        counts.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    return counts

default = faults_per_round()
applied = keep_freed_memory()
print(json.dumps({"default": default, "applied": applied, "kept": faults_per_round()}))
"""


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's mallopt is Linux/glibc only")
def test_freed_blocks_are_reused_without_page_faults():
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, check=True)
    result = json.loads(out.stdout.strip().splitlines()[-1])
    pages = 2 * 32 * 151936 * 4 // 4096  # two fp32 blocks per round
    default, kept = result["default"], result["kept"]
    assert result["applied"] is True
    # glibc's default hands freed blocks back to the kernel (how many depends on its adaptive
    # thresholds: 1,000-9,500 faults per round on average measured), so they fault in again ...
    assert sum(default) / len(default) > max(sum(kept) / len(kept), 100)
    # ... and kept, the rounds reuse the heap: once it has settled no round faults a block in again. CI
    # measured the settling: one block in one round (a mean of 593.5 over 8 rounds: 4,748 pages), and once
    # one block in each of two rounds ([0, 9496, 9497, 0, ...]), so at most two early rounds, the last four none
    faulted = [count >= pages / 20 for count in kept]
    assert sum(faulted) <= 2 and not any(faulted[-4:]), kept


def test_repeated_calls_are_cached():
    assert keep_freed_memory() is keep_freed_memory()
