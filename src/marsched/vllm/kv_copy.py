"""Moving KV blocks between the device cache and host memory, as vLLM's KV offloading does.

Pure torch (no vLLM import). `KvMover` holds one layer view per KV-cache tensor and the host
copies, keyed by request (or any key):

- host copies are allocated whole when a copy starts, pinned when the KV is on a CUDA device
  (plain host tensors otherwise), one `[blocks, ...]` tensor per layer;
- on CUDA every copy runs on a side stream (one for copies out, one for copies in), ordered
  after the compute stream's writes by events; an `Fence` (a CUDA event) marks the end of each
  chunk and completion is read by querying it: nothing waits on the host and nothing
  synchronizes the device;
- a copy out may arrive in chunks over several steps (`kv_copy_plan.OutPlanner` cuts them);
  when its last chunk is queued, `end_step` makes the compute stream wait for it (on the
  device) before the next step's forward, because the scheduler frees the blocks with this
  step's output and the next forward may write them;
- a copy in is needed by this step's forward: the compute stream waits for its event;
- on CPU the same calls copy synchronously (and a fence is passed when made).

Index tensors for CUDA copies go through pinned host memory with a non-blocking copy on the
side stream, so that building them never waits behind the compute stream.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from marsched.vllm.kv_copy_layout import BlockLayout


class Fence:
    """A point in a stream's work (a CUDA event), or, on CPU, the moment the work was done."""

    def __init__(self, stream: torch.cuda.Stream | None = None) -> None:
        self.event = None
        self.t = time.perf_counter()
        if stream is not None:
            self.event = torch.cuda.Event(enable_timing=True)
            self.event.record(stream)

    def query(self) -> bool:
        return self.event is None or self.event.query()

    def synchronize(self) -> None:
        """Wait on the host for this point (timing and shutdown only; the copy path never does)."""
        if self.event is not None:
            self.event.synchronize()

    def seconds_since(self, start: Fence) -> float:
        """Time from `start` to this fence; on CUDA both must have passed."""
        if self.event is None:
            return self.t - start.t
        return start.event.elapsed_time(self.event) / 1e3


@dataclass(eq=False)
class HostCopy:
    """A key's blocks in host memory: per layer `[total, ...]`, blocks `0 .. filled - 1` queued."""

    blocks: dict[str, torch.Tensor]
    total: int
    filled: int = 0
    last: Fence | None = None  # end of the newest chunk written into it

    @property
    def complete(self) -> bool:
        return self.filled == self.total

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.blocks.values())

    @property
    def pinned(self) -> bool:
        return all(t.is_pinned() for t in self.blocks.values())


@dataclass(eq=False)
class Transfer:
    """One chunk on its way: `blocks` blocks of `key`, out (to host) or in (to device)."""

    key: str
    out: bool
    blocks: int
    start: Fence
    end: Fence
    keep: list[torch.Tensor] = field(default_factory=list)  # tensors the copy reads or writes

    @property
    def done(self) -> bool:
        return self.end.query()

    def seconds(self) -> float:
        return self.end.seconds_since(self.start)


class KvMover:
    def __init__(self, kv_caches: dict[str, torch.Tensor], layouts: dict[str, BlockLayout]) -> None:
        if not kv_caches:
            raise ValueError("KvMover: no KV-cache tensors to copy")
        missing = sorted(set(kv_caches) - set(layouts))
        if missing:
            raise ValueError(f"KvMover: no block layout for KV-cache layers {missing}")
        # Layers that share one tensor (cross-layer KV sharing) are copied once.
        self.views: dict[str, torch.Tensor] = {}
        seen: set[tuple] = set()
        for name, kv in kv_caches.items():
            identity = (kv.data_ptr(), tuple(kv.shape), kv.stride(), kv.dtype)
            if identity not in seen:
                seen.add(identity)
                self.views[name] = layouts[name].blocks_view(kv)
        devices = {v.device for v in self.views.values()}
        if len(devices) != 1:
            raise ValueError(f"KvMover: KV-cache layers on several devices {sorted(map(str, devices))}")
        self.device = devices.pop()
        self.on_cuda = self.device.type == "cuda"
        self.host: dict[str, HostCopy] = {}
        self.in_flight: list[Transfer] = []
        self.stats = {"out_blocks": 0, "in_blocks": 0, "out_s": 0.0, "in_s": 0.0}
        self._out_stream = torch.cuda.Stream(self.device) if self.on_cuda else None
        self._in_stream = torch.cuda.Stream(self.device) if self.on_cuda else None
        self._outs_ended: list[Fence] = []  # copies out finished this step: compute waits for them
        self._step_end: Fence | None = None  # end of the last step's compute: the KV it wrote

    # --- host memory ---------------------------------------------------------------------

    def _allocate(self, total: int) -> HostCopy:
        return HostCopy({name: torch.empty((total, *view.shape[1:]), dtype=view.dtype, device="cpu",
                                           pin_memory=self.on_cuda)
                         for name, view in self.views.items()}, total)

    @property
    def host_bytes(self) -> int:
        return sum(copy.nbytes for copy in self.host.values())

    def drop(self, key: str) -> None:
        """Forget `key`'s host copy. A chunk still in flight keeps its tensors until it lands."""
        self.host.pop(key, None)

    # --- copies --------------------------------------------------------------------------

    def _indices(self, block_ids: list[int] | tuple[int, ...]) -> tuple[torch.Tensor, list[torch.Tensor]]:
        ids = torch.tensor(list(block_ids), dtype=torch.long)
        if not self.on_cuda:
            return ids, []
        ids = ids.pin_memory()
        return ids.to(self.device, non_blocking=True), [ids]  # on the current (side) stream

    def copy_out(self, key: str, block_ids: list[int] | tuple[int, ...], first: int = 0,
                 total: int | None = None) -> Transfer:
        """Copy device blocks `block_ids` into blocks `first ..` of `key`'s host copy of `total`
        blocks (default: just these). `first == 0` starts a new copy; later chunks follow in order."""
        started = Fence()  # on CPU the copy's time includes allocating its host memory
        n = len(block_ids)
        total = n if total is None else total
        if first == 0:
            self.host[key] = self._allocate(total)
        copy = self.host.get(key)
        if copy is None or copy.filled != first or copy.total != total or first + n > total:
            have = "none" if copy is None else f"{copy.filled} of {copy.total} blocks"
            raise ValueError(f"copy out of {key!r}: chunk of blocks {first}..{first + n - 1} of {total} does "
                             f"not follow the host copy's ({have})")
        if self.on_cuda:
            transfer = self._copy_out_cuda(key, copy, block_ids, first)
        else:
            ids, _ = self._indices(block_ids)
            for name, view in self.views.items():
                torch.index_select(view, 0, ids, out=copy.blocks[name].narrow(0, first, n))
            transfer = Transfer(key, True, n, started, Fence())
        copy.filled += n
        copy.last = transfer.end
        if copy.complete:
            self._outs_ended.append(transfer.end)
        self._track(transfer)
        return transfer

    def _copy_out_cuda(self, key: str, copy: HostCopy, block_ids: list[int] | tuple[int, ...],
                       first: int) -> Transfer:
        stream = self._out_stream
        compute = torch.cuda.current_stream(self.device)
        # The blocks hold KV written by earlier steps' forwards: wait for those, not for the
        # forward this step may just have launched.
        if self._step_end is not None:
            stream.wait_event(self._step_end.event)
        else:
            stream.wait_stream(compute)
        n = len(block_ids)
        with torch.cuda.stream(stream):
            start = Fence(stream)
            ids, keep = self._indices(block_ids)
            for name, view in self.views.items():
                staging = torch.index_select(view, 0, ids)  # freed on this stream: reused only after
                copy.blocks[name].narrow(0, first, n).copy_(staging, non_blocking=True)
            end = Fence(stream)
        return Transfer(key, True, n, start, end, keep + list(copy.blocks.values()))

    def copy_in(self, key: str, block_ids: list[int] | tuple[int, ...], first: int = 0,
                keep: bool = False) -> Transfer:
        """Write host blocks `first ..` of `key`'s copy into device blocks `block_ids`; the copy
        leaves `host` (a swapped request is read once) unless `keep` (a prefix store's block is
        read by every hit). The compute stream waits for it on the device."""
        copy = self.host.get(key) if keep else self.host.pop(key, None)
        n = len(block_ids)
        if copy is None or not copy.complete or first + n > copy.total:
            have = "no host copy" if copy is None else f"a host copy of {copy.filled} of {copy.total} blocks"
            raise ValueError(f"copy in of {key!r}: blocks {first}..{first + n - 1} asked for, {have}")
        if self.on_cuda:
            transfer = self._copy_in_cuda(key, copy, block_ids, first)
        else:
            start = Fence()
            ids, _ = self._indices(block_ids)
            for name, view in self.views.items():
                view.index_copy_(0, ids, copy.blocks[name].narrow(0, first, n))
            transfer = Transfer(key, False, n, start, Fence())
        self._track(transfer)
        return transfer

    def _copy_in_cuda(self, key: str, copy: HostCopy, block_ids: list[int] | tuple[int, ...],
                      first: int) -> Transfer:
        stream = self._in_stream
        compute = torch.cuda.current_stream(self.device)
        stream.wait_stream(compute)  # earlier writes to the destination blocks (their last owner, zeroing)
        if copy.last is not None and not copy.last.query():
            stream.wait_event(copy.last.event)  # its copy out is still on its way
        n = len(block_ids)
        with torch.cuda.stream(stream):
            start = Fence(stream)
            ids, keep = self._indices(block_ids)
            for name, view in self.views.items():
                staging = copy.blocks[name].narrow(0, first, n).to(self.device, non_blocking=True)
                view.index_copy_(0, ids, staging)
            end = Fence(stream)
        compute.wait_event(end.event)  # this step's forward reads these blocks
        return Transfer(key, False, n, start, end, keep + list(copy.blocks.values()))

    # --- steps ---------------------------------------------------------------------------

    def end_step(self) -> None:
        """The step's forward has been queued: order the next step's compute after the copies out
        that finished this step (their blocks are freed), and mark the KV this step wrote."""
        if self.on_cuda:
            compute = torch.cuda.current_stream(self.device)
            for fence in self._outs_ended:
                compute.wait_event(fence.event)
            self._step_end = Fence(compute)
        self._outs_ended.clear()
        self.poll()

    def _track(self, transfer: Transfer) -> None:
        self.in_flight.append(transfer)
        self.poll()

    def poll(self) -> list[Transfer]:
        """Retire the chunks that have landed (event query); returns them."""
        landed, going = [], []
        for transfer in self.in_flight:
            (landed if transfer.done else going).append(transfer)
        self.in_flight = going
        for transfer in landed:
            way = "out" if transfer.out else "in"
            self.stats[f"{way}_blocks"] += transfer.blocks
            self.stats[f"{way}_s"] += transfer.seconds()
            transfer.keep.clear()
        return landed

    def wait(self, transfer: Transfer) -> None:
        """Wait on the host until `transfer` has landed (timing, tests and shutdown only)."""
        transfer.end.synchronize()
        self.poll()

    def shutdown(self) -> None:
        for transfer in list(self.in_flight):
            transfer.end.synchronize()
        self.poll()
        self.host.clear()
