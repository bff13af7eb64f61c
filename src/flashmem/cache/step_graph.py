"""The static decode step replayed from a CUDA graph (`decode_step: graph`).

A static step (cache/static_step.py) is a fixed list of operators in a segment: the same
shapes, the same addresses, no value read by the host. On an H200 eager PyTorch spent about
63 us of the host's time a kernel on flashmem's step, against 0.85 us a kernel replayed from a
CUDA graph (docs/accelerator.md). So each layer's `device_step` is captured once per segment,
after one warm-up step, and replayed for the segment's other steps with the step's inputs
copied into the graph's own.

- The graph's attention buffers are allocated inside the capture, from a memory pool that the
  thread's graphs share (as the eager step's scratch is one set per thread): graphs replay in
  the order they were captured, one at a time, so a layer's buffers are the next layer's.
- A segment's first step reads every ranked page (its shapes differ from the others') and runs
  eagerly, and so does the warm-up; a capture that fails (a gather whose ids must cross to the
  host, where the cold tier has no device view: store/mapped.py) leaves the segment static and
  eager, counted in `memory_report()["static_graph_failures"]`.
- Off CUDA a graph step runs as the static step; `EmulatedGraph` stands in for a CUDA graph in
  tests and in `benchmarks/diagnostics/static_step_gpu.py --emulate-graphs` (`GRAPH` below).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch

Step = Callable[..., tuple[torch.Tensor, ...]]


class EmulatedGraph:
    """A stand-in for torch.cuda.CUDAGraph off CUDA: `capture` runs the call once for its
    outputs and puts back the state it wrote (a real capture runs nothing), `replay` runs it
    again and writes its results into the captured outputs."""

    def __init__(self) -> None:
        self.fn: Callable[[], tuple[torch.Tensor, ...]] | None = None
        self.outs: tuple[torch.Tensor, ...] = ()

    def capture(
        self, fn: Callable[[], tuple[torch.Tensor, ...]], state: list[torch.Tensor]
    ) -> tuple[torch.Tensor, ...]:
        saved = [t.clone() for t in state]
        self.fn = fn
        self.outs = tuple(t.clone() for t in fn())
        for t, s in zip(state, saved, strict=True):
            t.copy_(s)
        return self.outs

    def replay(self) -> None:
        assert self.fn is not None
        for dst, src in zip(self.outs, self.fn(), strict=True):
            dst.copy_(src)


class CudaGraph:
    """torch.cuda.CUDAGraph, captured in the thread's shared pool."""

    def __init__(self) -> None:
        self.graph = torch.cuda.CUDAGraph()

    def capture(
        self, fn: Callable[[], tuple[torch.Tensor, ...]], state: list[torch.Tensor]
    ) -> tuple[torch.Tensor, ...]:
        del state  # a real capture runs nothing: the state is untouched
        # thread_local: the cold tier's loader threads may touch CUDA while this thread captures
        with torch.cuda.graph(self.graph, pool=_pool(), capture_error_mode="thread_local"):
            return fn()

    @staticmethod
    def warm_up(fn: Callable[[], tuple[torch.Tensor, ...]]) -> tuple[torch.Tensor, ...]:
        """The step before a capture, on a side stream (as PyTorch's CUDA graph notes advise:
        libraries set up their handles and workspaces outside the capture)."""
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            out = fn()
        torch.cuda.current_stream().wait_stream(side)
        return out

    def replay(self) -> None:
        self.graph.replay()


# What a graph step captures with: None (the default) a CUDA graph on CUDA and none elsewhere;
# tests and `--emulate-graphs` set EmulatedGraph to run the bookkeeping on a CPU.
GRAPH: type[EmulatedGraph] | None = None

_local = threading.local()


def _pool() -> Any:
    """The thread's graph memory pool (`torch.cuda.graph_pool_handle`), made once."""
    if getattr(_local, "pool", None) is None:
        _local.pool = torch.cuda.graph_pool_handle()
    return _local.pool


def graph_kind(device: torch.device, readable: bool) -> type[EmulatedGraph] | type[CudaGraph] | None:
    """What a segment captures with on `device`; `readable`: the cold tier (and the re-rank's
    codes) can be gathered by the device without the ids crossing to the host."""
    if GRAPH is not None:
        return GRAPH
    return CudaGraph if device.type == "cuda" and readable else None


class StepGraph:
    """One layer's `device_step` in one segment: eager for the warm-up step, then captured, then
    replayed. `inputs` are the step's tensors [q, qg, k_new, v_new, valid_new]; `buffers` makes
    attention's K/V and mask buffers (inside the capture: from the pool)."""

    def __init__(
        self, kind: type[EmulatedGraph] | type[CudaGraph], state: list[torch.Tensor], counts: dict[str, int]
    ) -> None:
        self.kind = kind
        self.state = state  # what the step writes (restored after an emulated capture)
        self.counts = counts  # the layer's captures, replays and failures (memory_report)
        self.graph: EmulatedGraph | CudaGraph | None = None
        self.inputs: list[torch.Tensor] = []
        self.outs: tuple[torch.Tensor, ...] = ()
        self.warm = False
        self.failed: str | None = None

    def run(
        self,
        step: Step,
        inputs: list[torch.Tensor],
        rest: tuple[Any, ...],
        buffers: Callable[[], tuple[torch.Tensor, torch.Tensor]],
        scratch: tuple[torch.Tensor, torch.Tensor],
    ) -> tuple[torch.Tensor, ...] | None:
        """The step's outputs (counts copied out of the graph's, which the next replay writes),
        or None where it must run eagerly: after a failed capture, or an emulated warm-up.
        scratch: the eager step's attention buffers, for the warm-up."""
        if self.failed is not None:
            return None
        if not self.warm:
            self.warm = True
            if self.kind is CudaGraph:
                return CudaGraph.warm_up(lambda: step(*inputs, *rest, *scratch))
            return None
        if self.graph is None:
            self.inputs = [t.clone() for t in inputs]
            ins = self.inputs
            graph = self.kind()

            def call() -> tuple[torch.Tensor, ...]:
                return step(*ins, *rest, *buffers())

            try:
                self.outs = graph.capture(call, self.state)
            except Exception as exc:  # noqa: BLE001 - recorded; the segment runs eagerly
                self.failed = f"{type(exc).__name__}: {exc}"
                self.counts["failures"] += 1
                return None
            self.graph = graph
            self.counts["captures"] += 1
        for dst, src in zip(self.inputs, inputs, strict=True):
            dst.copy_(src)
        self.graph.replay()
        self.counts["replays"] += 1
        out, *counts = self.outs
        return (out, *(c.clone() for c in counts))
