"""KV transfer throughput: each backend on this machine against a plain memory copy (issue 5).

This module owns the transfer micro-benchmark. A server process holds a real `KVCache` (shared
memory on the CPU, device memory for cuda_ipc) and serves it with the backend; this process reads
blocks of it through the backend's ordinary interface (submit a TransferJob, poll the result), for
KV sizes from 64 KB to 256 MB; a transfer's time is its TransferResult.seconds (the backend's
own read, without queueing). The ceiling is `dst.copy_(src)` of one contiguous tensor of the same
bytes in this process, measured just before each point so both see the same load on a shared
host. Each point is the median of `repeats` after one warm-up (`first_s`: it pays page faults on
pages no earlier point touched, and the first mapping). Every point's bytes are checked against
the server's fill pattern, so a fast wrong copy cannot pass.

Block ids are "contiguous" (a fresh pool hands out runs) or "scattered" (a pool after churn: a
random permutation), since the backends copy one run of consecutive ids at a time.

    run_transfer_throughput(ThroughputOptions(...)) -> dict   # also writes JSON and a PNG
    python -m bench.transfer_throughput --out transfer.json

torch and the transfer backends are imported inside functions, so importing this module (as the
CLI's argument parsing does) stays as light as the rest of `bench`.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

KB, MB = 1 << 10, 1 << 20
DEFAULT_SIZES = tuple(64 * KB * 4 ** i for i in range(7))  # 64 KB .. 256 MB
FILL_MODULUS = 251  # fill values 0..250: exact in bfloat16 and float16


@dataclass(frozen=True)
class ThroughputOptions:
    sizes: tuple[int, ...] = DEFAULT_SIZES
    backends: tuple[str, ...] = ("shm", "tcp", "ucx", "cuda_ipc")
    patterns: tuple[str, ...] = ("contiguous", "scattered")
    repeats: int = 5
    # The KV layout: 8 layers x 2 KV heads x 64 dims in bfloat16, 16-token blocks = 64 KB a
    # block, so every size is a whole number of blocks (the default model's blocks are 360 KB).
    num_layers: int = 8
    num_kv_heads: int = 2
    head_dim: int = 64
    block_size: int = 16
    dtype: str = "bfloat16"
    ucx_tls: str | None = "tcp"  # UCX_TLS for the ucx rows (None: let UCX choose)
    out: str = "transfer_throughput.json"
    png: str | None = None  # None: the JSON path with .png
    timeout_s: float = 120.0
    seed: int = 0
    # torch threads in both processes. 1, as instances run by default (--threads-per-instance):
    # on a loaded 2-core host a 2-thread copy waits a scheduler tick (~12 ms) for its second thread.
    threads: int = 1

    def layout(self):
        from common.engine.kv_cache import KVLayout

        probe = KVLayout(self.num_layers, 1, self.block_size, self.num_kv_heads, self.head_dim,
                         self.dtype)
        num_blocks = max(1, max(self.sizes) // probe.bytes_per_block)
        return probe.with_num_blocks(num_blocks)


# -- the fill pattern: value = flat element index mod 251 ------------------------------------------
def fill_pattern(tensor) -> None:
    """Fill [layers, 2, blocks, ...] so every element tells where it came from."""
    import torch

    per_plane = tensor[0, 0].numel()
    for layer in range(tensor.shape[0]):
        for kv in range(2):
            start = (layer * 2 + kv) * per_plane
            values = (torch.arange(start, start + per_plane) % FILL_MODULUS).to(tensor.dtype)
            tensor[layer, kv].copy_(values.view(tensor[layer, kv].shape))


def expected_block(layout, block_id: int):
    """What `fill_pattern` wrote into one block: [layers, 2, block elements] (CPU)."""
    import torch

    element_count = layout.block_size * layout.num_kv_heads * layout.head_dim
    planes = torch.arange(layout.num_layers * 2).view(layout.num_layers, 2, 1)
    flat = (planes * layout.num_blocks + block_id) * element_count + torch.arange(element_count)
    return flat % FILL_MODULUS


def check_blocks(tensor, layout, remote_ids: list[int], local_ids: list[int]) -> None:
    """The first and last block of a job hold the server's pattern for their remote ids."""
    for remote, local in {(remote_ids[0], local_ids[0]), (remote_ids[-1], local_ids[-1])}:
        got = tensor[:, :, local].reshape(layout.num_layers, 2, -1).cpu().long()
        if not got.equal(expected_block(layout, remote)):
            raise AssertionError(f"block {local} does not hold remote block {remote}")


# -- the server process ----------------------------------------------------------------------------
def serve_blocks(backend: str, layout_fields: dict, device: str, conn, threads: int = 1) -> None:
    """Child process: hold a filled KV cache served by `backend` until told to stop."""
    import torch

    from common.config import TransferConfig
    from common.engine.kv_cache import KVCache, KVLayout
    from kv_transfer import make_backend

    torch.set_num_threads(threads)
    try:
        cache = KVCache(KVLayout(**layout_fields), device=device, shared_memory=device == "cpu")
        fill_pattern(cache.tensor)
        server = make_backend(backend, cache, "127.0.0.1", TransferConfig(backend=backend))
        server.start()
    except Exception as exc:  # reported to the parent as one line, not a traceback in a child
        conn.send(("error", f"{type(exc).__name__}: {exc}"))
        return
    conn.send(("ready", server.endpoint))
    try:
        conn.recv()  # "stop", or EOF when the parent died
    except EOFError:
        pass
    server.close()
    cache.close()


def start_server(backend: str, layout, device: str = "cpu", timeout_s: float = 60.0,
                 threads: int = 1):
    """(process, endpoint, conn) of a fresh server process; raises RuntimeError if it failed."""
    import torch.multiprocessing

    # spawn, not fork: the parent may hold threads (UCX's, ZeroMQ's) and a CUDA context.
    ctx = torch.multiprocessing.get_context("spawn")
    parent, child = ctx.Pipe()
    process = ctx.Process(target=serve_blocks, daemon=True,
                          args=(backend, asdict(layout), device, child, threads))
    process.start()
    child.close()
    try:
        if not parent.poll(timeout_s):
            raise EOFError(f"no word within {timeout_s} s")
        status, detail = parent.recv()
    except EOFError as exc:  # it died or hung before saying ready
        process.kill()
        raise RuntimeError(f"the {backend} server did not start: {exc or 'it exited'}") from None
    if status != "ready":
        process.join(5)
        raise RuntimeError(f"the {backend} server failed: {detail}")
    return process, detail, parent


def stop_server(process, conn) -> None:
    try:
        conn.send("stop")
    except (BrokenPipeError, OSError):
        pass  # already gone
    process.join(10)
    if process.is_alive():
        process.kill()
        process.join(5)


# -- measurements ----------------------------------------------------------------------------------
def measure_ceiling(num_bytes: int, repeats: int, device: str) -> dict:
    """Seconds for dst.copy_(src) of `num_bytes` contiguous bytes: warm-up, then the median."""
    import torch

    src = torch.full((num_bytes,), 7, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    times = []
    for _ in range(repeats + 1):
        if device != "cpu":
            torch.cuda.synchronize()
        started = time.perf_counter()
        dst.copy_(src)
        if device != "cpu":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - started)
    return {"first_s": times[0], "median_s": statistics.median(times[1:])}


def block_ids(pattern: str, count: int, num_blocks: int, rng: random.Random) -> list[int]:
    if pattern == "contiguous":
        return list(range(count))
    if pattern == "scattered":
        return rng.sample(range(num_blocks), count)
    raise ValueError(f"unknown block pattern {pattern!r}")


def transfer_once(reader, job, timeout_s: float):
    """Submit one job and wait for its result (the backend's own timing is in `seconds`)."""
    reader.submit(job)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        results = reader.poll()
        if results:
            return results[0]
        time.sleep(0.0002)
    raise TimeoutError(f"no result for {job.request_id} within {timeout_s} s")


def measure_point(reader, endpoint: str, layout, ids: tuple[list[int], list[int]],
                  options: ThroughputOptions) -> dict:
    """Warm-up plus `repeats` reads of the same blocks; returns first and median seconds."""
    from common.transfer import TransferJob

    remote, local = ids

    def read_seconds() -> float:
        job = TransferJob("bench", endpoint, remote, local, time.monotonic() + options.timeout_s)
        result = transfer_once(reader, job, options.timeout_s + 5)
        if not result.ok:
            raise RuntimeError(f"transfer failed: {result.error}")
        return result.seconds

    times = [read_seconds() for _ in range(options.repeats + 1)]
    reader.kv_cache.tensor[:, :, local[0]].zero_()  # so the check sees the next read's bytes
    read_seconds()
    check_blocks(reader.kv_cache.tensor, layout, remote, local)
    return {"first_s": times[0], "median_s": statistics.median(times[1:])}


def device_for(backend: str) -> str:
    return "cuda" if backend == "cuda_ipc" else "cpu"


def open_reader(backend: str, layout, device: str):
    """This process's end; raises the backend's one-line error when it cannot run here."""
    import torch

    from common.config import TransferConfig
    from common.engine.kv_cache import KVCache
    from kv_transfer import make_backend
    from kv_transfer.cuda_ipc import CudaIpcUnavailable

    if device == "cuda" and not torch.cuda.is_available():  # else KVCache fails less clearly
        raise CudaIpcUnavailable("the cuda_ipc backend needs CUDA (none on this machine)")
    cache = KVCache(layout, device=device, shared_memory=device == "cpu")
    try:
        reader = make_backend(backend, cache, "127.0.0.1", TransferConfig(backend=backend))
    except Exception:
        cache.close()
        raise
    reader.start()
    return reader


def measure_backend(backend: str, layout, options: ThroughputOptions) -> list[dict]:
    """One row per (pattern, size) for `backend`: a server process, this process reading. Each
    row's ceiling is measured just before it, so both see the same load on a shared host."""
    device = device_for(backend)
    reader = open_reader(backend, layout, device)
    process = conn = None
    try:
        process, endpoint, conn = start_server(backend, layout, device, threads=options.threads)
        rng = random.Random(options.seed)
        rows = []
        for pattern in options.patterns:
            for size in options.sizes:
                count = max(1, size // layout.bytes_per_block)
                ids = (block_ids(pattern, count, layout.num_blocks, rng),
                       block_ids(pattern, count, layout.num_blocks, rng))
                num_bytes = count * layout.bytes_per_block
                ceiling = measure_ceiling(num_bytes, options.repeats, device)
                point = measure_point(reader, endpoint, layout, ids, options)
                rows.append(make_row(backend, pattern, size, num_bytes, point, ceiling))
        return rows
    finally:
        reader.close()
        reader.kv_cache.close()
        if process is not None:
            stop_server(process, conn)


def make_row(backend: str, pattern: str, size: int, num_bytes: int, point: dict,
             ceiling: dict) -> dict:
    gbps = num_bytes / point["median_s"] / 1e9
    ceiling_gbps = num_bytes / ceiling["median_s"] / 1e9
    return {"backend": backend, "device": device_for(backend), "pattern": pattern, "size": size,
            "bytes": num_bytes, "median_s": point["median_s"], "first_s": point["first_s"],
            "gbps": gbps, "ceiling_gbps": ceiling_gbps, "ratio": gbps / ceiling_gbps}


def run_transfer_throughput(options: ThroughputOptions) -> dict:
    """Measure every requested backend; write the JSON (and PNG) and return the same dict."""
    import torch

    from kv_transfer.cuda_ipc import CudaIpcUnavailable
    from kv_transfer.ucx import UcxUnavailable

    torch.set_num_threads(options.threads)
    layout = options.layout()
    rows, unavailable, failed = [], {}, {}
    for backend in options.backends:
        saved = dict(os.environ)
        if backend == "ucx" and options.ucx_tls:
            # UCX reads UCX_TLS when its context starts: before this process's first UCX call,
            # and in the server, which inherits it. A context started earlier keeps its choice.
            os.environ["UCX_TLS"] = options.ucx_tls
        try:
            rows += measure_backend(backend, layout, options)
        except (UcxUnavailable, CudaIpcUnavailable) as exc:
            unavailable[backend] = str(exc)
        except (RuntimeError, TimeoutError, AssertionError) as exc:
            failed[backend] = f"{type(exc).__name__}: {exc}"
        finally:
            os.environ.clear()
            os.environ.update(saved)
    report = {"options": asdict(options), "layout": asdict(layout), "machine": machine_info(),
              "rows": rows, "unavailable": unavailable, "failed": failed}
    write_outputs(report, options)
    return report


def machine_info() -> dict:
    import torch

    from bench.machine import cpu_kind

    return {"host": platform.node(), "cpu": cpu_kind(), "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "torch": torch.__version__, "torch_threads": torch.get_num_threads(),
            "load_average": os.getloadavg(), "time": time.strftime("%Y-%m-%d %H:%M:%S")}


def write_outputs(report: dict, options: ThroughputOptions) -> None:
    out = Path(options.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    plot(report, Path(options.png) if options.png else out.with_suffix(".png"))


def plot(report: dict, path: Path) -> None:
    """Throughput vs size, log-log: one line per backend and pattern, the ceiling in black."""
    import matplotlib

    matplotlib.use("Agg")  # no display: the PNG is the output
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for device, style in (("cpu", "k-"), ("cuda", "k--")):
        by_size: dict[int, list[float]] = {}
        for row in report["rows"]:
            if row["device"] == device:
                by_size.setdefault(row["bytes"], []).append(row["ceiling_gbps"])
        if by_size:  # the median of the ceilings measured beside each backend's point
            sizes = sorted(by_size)
            ax.plot(sizes, [statistics.median(by_size[n]) for n in sizes], style, linewidth=2,
                    label=f"copy ceiling ({device}, median)")
    series = sorted({(r["backend"], r["pattern"]) for r in report["rows"]})
    palette = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    colors = dict(zip(sorted({b for b, _ in series}), palette))
    for backend, pattern in series:
        rows = [r for r in report["rows"] if (r["backend"], r["pattern"]) == (backend, pattern)]
        ax.plot([r["bytes"] for r in rows], [r["gbps"] for r in rows], marker="o",
                color=colors[backend], linestyle="-" if pattern == "contiguous" else ":",
                label=f"{backend} ({pattern})")
    ax.set(xscale="log", yscale="log", xlabel="KV bytes per transfer", ylabel="GB/s",
           title="KV transfer throughput (median)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def format_table(report: dict) -> str:
    lines = ["| backend | block ids | size | GB/s (median) | ceiling GB/s | ratio | first (ms) |",
             "|---|---|---|---|---|---|---|"]
    for r in report["rows"]:
        lines.append(f"| {r['backend']} | {r['pattern']} | {human(r['bytes'])} | {r['gbps']:.2f} "
                     f"| {r['ceiling_gbps']:.2f} | {r['ratio']:.2f} | {r['first_s'] * 1e3:.1f} |")
    for name, why in {**report["unavailable"], **report["failed"]}.items():
        lines.append(f"| {name} | not measured: {why} | | | | | |")
    return "\n".join(lines)


def human(num_bytes: int) -> str:
    return f"{num_bytes // MB} MB" if num_bytes >= MB else f"{num_bytes // KB} KB"


def parse_args(argv: list[str] | None = None) -> ThroughputOptions:
    defaults = ThroughputOptions()
    parser = argparse.ArgumentParser(prog="python -m bench.transfer_throughput",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default=",".join(str(s) for s in defaults.sizes),
                        help="bytes per transfer, comma-separated")
    parser.add_argument("--backends", default=",".join(defaults.backends))
    parser.add_argument("--patterns", default=",".join(defaults.patterns))
    parser.add_argument("--repeats", type=int, default=defaults.repeats)
    parser.add_argument("--threads", type=int, default=defaults.threads,
                        help="torch threads in the reader and the server process")
    parser.add_argument("--ucx-tls", default=defaults.ucx_tls,
                        help="UCX_TLS for the ucx rows; 'auto' lets UCX choose")
    parser.add_argument("--out", default=defaults.out)
    parser.add_argument("--png", default=None)
    args = parser.parse_args(argv)
    return replace(defaults, sizes=tuple(int(s) for s in args.sizes.split(",")),
                   backends=tuple(args.backends.split(",")),
                   patterns=tuple(args.patterns.split(",")), repeats=args.repeats,
                   threads=args.threads, ucx_tls=None if args.ucx_tls == "auto" else args.ucx_tls,
                   out=args.out, png=args.png)


def main(argv: list[str] | None = None) -> None:
    options = parse_args(argv)
    report = run_transfer_throughput(options)
    print(format_table(report))
    print(f"wrote {options.out}")


if __name__ == "__main__":
    main()
