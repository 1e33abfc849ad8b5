"""The second KV tier: a host-memory block tensor, and the copies a plan's swaps ask for.

`HostSwapSpace` holds one CPU tensor with the KV cache's layout but its own number of blocks
(host block ids are bookkept by `common.schedulers.swapping.SwapSpace`, on the scheduler's side).
The model runner calls `run_swaps` before a plan's forward: every swap-out first (device -> host),
then every swap-in (host -> device), so a device block a swap-out frees may be refilled by a
swap-in or by the forward of the same plan.

Bandwidth emulation: the copy really happens (memcpy on CPU, a device-to-host copy on CUDA); then
the call sleeps what is left of bytes / bandwidth, so a tier behind e.g. PCIe 4.0 x16 (~25 GB/s)
or a slower link can be modelled on a CPU-only machine. `bandwidth_bytes_per_s=None` means as
fast as the copy goes. The wait blocks the instance loop, like a synchronous swap would: this
emulation does not overlap swaps with compute (FastServe overlaps them; see docs/coupled.md).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from common.engine.kv_cache import DTYPE_BY_NAME, KVCache, KVLayout
from common.plan import BatchPlan


@dataclass
class SwapStats:
    """Totals since start: what was moved and how long it took (copy, then emulated wait)."""

    num_blocks_out: int = 0
    num_blocks_in: int = 0
    copy_seconds: float = 0.0
    wait_seconds: float = 0.0

    @property
    def seconds(self) -> float:
        return self.copy_seconds + self.wait_seconds


class HostSwapSpace:
    def __init__(self, layout: KVLayout, num_host_blocks: int,
                 bandwidth_bytes_per_s: float | None = None, pin_memory: bool = False) -> None:
        if num_host_blocks <= 0:
            raise ValueError("a host swap space needs at least one block")
        if bandwidth_bytes_per_s is not None and not bandwidth_bytes_per_s > 0:
            raise ValueError(f"swap bandwidth must be > 0 bytes/s, got {bandwidth_bytes_per_s}")
        self.layout = layout.with_num_blocks(num_host_blocks)
        self.bandwidth_bytes_per_s = bandwidth_bytes_per_s
        # [layers, 2, num_host_blocks, block_size, kv_heads, head_dim], like the device cache
        self.tensor = torch.zeros(self.layout.shape, dtype=DTYPE_BY_NAME[layout.dtype],
                                  pin_memory=pin_memory)
        self.stats = SwapStats()

    @property
    def num_blocks(self) -> int:
        return self.layout.num_blocks

    def _copy_out(self, cache: KVCache, pairs: list[tuple[int, int]]) -> None:
        device_ids = torch.tensor([d for d, _ in pairs], dtype=torch.long, device=cache.device)
        host_ids = torch.tensor([h for _, h in pairs], dtype=torch.long)
        data = cache.tensor.index_select(2, device_ids).to("cpu")  # [L, 2, n, bs, KVH, D]
        self.tensor.index_copy_(2, host_ids, data)

    def _copy_in(self, cache: KVCache, pairs: list[tuple[int, int]]) -> None:
        host_ids = torch.tensor([h for h, _ in pairs], dtype=torch.long)
        device_ids = torch.tensor([d for _, d in pairs], dtype=torch.long, device=cache.device)
        data = self.tensor.index_select(2, host_ids).to(cache.device)  # [L, 2, n, bs, KVH, D]
        cache.tensor.index_copy_(2, device_ids, data)

    def execute(self, cache: KVCache, swap_out: list[tuple[int, int]],
                swap_in: list[tuple[int, int]]) -> float:
        """Copy the swap-outs, then the swap-ins; wait out the emulated bandwidth. Returns the
        seconds the call took."""
        if cache.layout.with_num_blocks(self.num_blocks) != self.layout:
            raise ValueError("the host swap space and the KV cache have different layouts")
        started = time.perf_counter()
        if swap_out:
            self._copy_out(cache, swap_out)
        if swap_in:
            self._copy_in(cache, swap_in)
        if cache.device.type == "cuda":
            torch.cuda.synchronize(cache.device)  # the copy's time must be measured, not queued
        copied = time.perf_counter() - started
        self.stats.num_blocks_out += len(swap_out)
        self.stats.num_blocks_in += len(swap_in)
        self.stats.copy_seconds += copied
        wait = self._emulated_seconds(len(swap_out) + len(swap_in)) - copied
        if wait > 0:
            time.sleep(wait)
            self.stats.wait_seconds += wait
        return time.perf_counter() - started

    def _emulated_seconds(self, num_blocks: int) -> float:
        if self.bandwidth_bytes_per_s is None:
            return 0.0
        return num_blocks * self.layout.bytes_per_block / self.bandwidth_bytes_per_s


def run_swaps(swap_space: HostSwapSpace | None, cache: KVCache, plan: BatchPlan) -> None:
    """The runner's hook: execute the plan's swaps (a plan with swaps needs a swap space)."""
    if not plan.has_swaps:
        return
    if swap_space is None:
        raise RuntimeError("the plan swaps KV blocks but this runner has no host swap space "
                           "(attach a common.engine.swap.HostSwapSpace)")
    swap_space.execute(cache, plan.swap_out, plan.swap_in)


def attach_host_tier(runner, num_host_blocks: int, bandwidth: float | None) -> None:
    """Give `runner` a host swap tier of `num_host_blocks` (kept if it already has that size)."""
    current = runner.swap_space
    if current is None or current.num_blocks != num_host_blocks:
        runner.swap_space = HostSwapSpace(runner.kv_layout, num_host_blocks, bandwidth,
                                          pin_memory=runner.device.type == "cuda")
