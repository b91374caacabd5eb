"""The data path behind the step: this rank's micro-batches read, collated and copied ahead of it.

    steps = plan_steps(data.lengths, data.train_ids, batch_size, num_micro, seed, epoch, batch_pos)
    with BatchLoader(data, steps, device, dtype, rank=rank, world=world, workers=2) as loader:
        # batches: this rank's micro[rank::world], collated
        for (epoch, pos, micro), batches in loader:
            ...

Background threads read each coming micro-batch straight from the shard files (os.preadv into the
batch's own buffer, page-locked on a GPU: no intermediate copy, the GIL released while reading) into
a bounded window of `ahead` micro-batches, in plan order. The main thread copies the next one to the
GPU on a side stream (non_blocking, from pinned memory) as soon as it hands the current one over,
so the copy runs under the current step; an event hands it to the step's stream. FP8 shards travel
as FP8 with their scales (half the bytes) and are dequantized on the GPU; other stored dtypes are
cast there. The batches are bit for bit those of `collate([data.sample(i) ...], device, dtype, ids)`
(eyas/training/batches.py), in the same order: the same arithmetic (e4m3 -> fp32, x scale, -> bf16,
-> dtype), elementwise. workers=0 is that synchronous path itself, inside the step.

`wait_s` sums the time the step waited for data (the queue; 0 in steady state when the workers keep
up). Closing (the `with` block's end, also on an error, KeyboardInterrupt or a SIGTERM handler's
exception) stops the workers: pending reads are dropped, a read in progress stops at its next
chunk, and every thread is joined. The threads are daemons besides, so nothing can hold the
process open.
"""

from __future__ import annotations

import collections
import os
import queue
import threading
import time
from concurrent.futures import Future
from typing import Iterable, Iterator

import torch

from eyas.dump import Header, HeaderError, read_header
from eyas.errors import InvalidInput
from eyas.extraction.shards import ShardError
from eyas.training.batches import Batch, ShardData, collate, epoch_plan

#: bytes per read call: a closing loader stops a worker within one chunk
READ_CHUNK = 64 << 20
THREAD_PREFIX = "eyas-loader"
STOP_POLL_S = 0.2  #: how often an idle worker looks whether the loader stopped


def plan_steps(
    lengths: list[int],
    ids: list[int],
    micro: int,
    num_micro: int,
    seed: int,
    epoch: int,
    pos: int,
    window: int = 16,
) -> Iterator[tuple[int, int, list[list[int]]]]:
    """(epoch, position in it, micro-batches) of every step from `pos` of `epoch` on, epoch after
    epoch (epoch_plan's; a position past an epoch's end starts the next epoch)."""
    while True:
        plan = epoch_plan(lengths, ids, micro, num_micro, seed, epoch, window)
        for p in range(pos, len(plan)):
            yield epoch, p, plan[p]
        epoch, pos = epoch + 1, 0


class _Stopped(Exception):
    """A read given up because the loader is closing."""


class BatchLoader:
    """This rank's micro-batches of `steps` (items ending with the step's micro-batches of all
    ranks), collated, ahead of the step; iterating gives (item, [batch, ...]) per step. See the
    module doc."""

    def __init__(
        self,
        data: ShardData,
        steps: Iterable[tuple],
        device,
        dtype=torch.float32,
        *,
        rank: int = 0,
        world: int = 1,
        workers: int = 2,
        ahead: int | None = None,
    ):
        self.data, self.device, self.dtype = data, torch.device(device), dtype
        self.rank, self.world, self.workers = rank, world, workers
        self.ahead = max(1, ahead if ahead is not None else workers + 1)  # micro-batches read ahead
        self.cuda = self.device.type == "cuda"
        self.wait_s = 0.0  # time the step waited for data
        self.read_bytes = 0  # bytes read from the shards (by the workers)
        self.empty = (
            torch.empty
        )  # the batches' buffers (bench/loader.py reuses them, as the pinned allocator does)
        self._steps = iter(steps)
        self._pending: collections.deque = collections.deque()  # [item, [slot, ...]], plan order
        self._queued = 0  # micro-batches in _pending
        self._exhausted = False
        self._stop = threading.Event()
        self._jobs: queue.Queue = queue.Queue()
        self._headers: dict = {}  # shard path -> its Header
        self._lock = threading.Lock()
        self._stream = torch.cuda.Stream(self.device) if self.cuda and workers else None
        self._threads = [
            threading.Thread(target=self._work, name=f"{THREAD_PREFIX}-{i}", daemon=True)
            for i in range(workers)
        ]
        for t in self._threads:
            t.start()
        if workers:
            self._fill()  # the first micro-batches are read while the caller sets up

    # -------------------------------------------------------------- the main thread's side

    def __iter__(self):
        return self

    def __next__(self) -> tuple[tuple, list[Batch]]:
        if self._stop.is_set():
            raise StopIteration
        # synchronous: the step itself reads, collates and copies
        if self.workers == 0:
            item = next(self._steps)
            return item, [
                collate([self.data.sample(i) for i in m], self.device, self.dtype, ids=m)
                for m in item[-1][self.rank :: self.world]
            ]
        self._fill()
        if not self._pending:
            raise StopIteration
        item, slots = self._pending.popleft()
        self._queued -= len(slots)
        batches = [self._hand_over(s) for s in slots]
        self._fill()
        self._copy_ahead()
        return item, batches

    def _fill(self) -> None:
        """Queue the coming steps' micro-batches for the workers, up to `ahead` (at least one
        step)."""
        while not self._exhausted and (self._queued < self.ahead or not self._pending):
            try:
                item = next(self._steps)
            except StopIteration:
                self._exhausted = True
                return
            slots = []
            for m in item[-1][self.rank :: self.world]:
                slot = {"ids": list(m), "host": Future(), "device": None}
                self._jobs.put(slot)
                slots.append(slot)
            self._pending.append((item, slots))
            self._queued += len(slots)

    def _hand_over(self, slot: dict) -> Batch:
        t0 = time.perf_counter()
        host = slot["host"].result()  # a worker's exception is raised here
        if slot["device"] is None:
            self._to_device(slot, host)
        self.wait_s += time.perf_counter() - t0
        batch, event = slot["device"]
        if event is not None:
            stream = torch.cuda.current_stream(self.device)
            stream.wait_event(event)
            # its memory goes back to the side stream after the step's use
            for t in batch.tensors():
                t.record_stream(stream)
        return batch

    def _copy_ahead(self) -> None:
        """Start the next micro-batch's copy to the GPU now, under the step about to run, if it is
        read."""
        if not self.cuda or not self._pending:
            return
        slot = self._pending[0][1][0]
        if slot["device"] is None and slot["host"].done() and not slot["host"].cancelled():
            self._to_device(slot, slot["host"].result())

    def _to_device(self, slot: dict, host: Batch | dict) -> None:
        if not self.cuda:  # host_batch made the step's Batch
            slot["device"] = (host, None)
            return
        with torch.cuda.stream(self._stream):
            if isinstance(host, Batch):  # collated on the host already (_collated_on_host)
                batch = host.apply(lambda t: t.to(self.device, non_blocking=True))
            else:
                batch = self._from_stored(host)
            event = torch.cuda.Event()
            event.record(self._stream)
        slot["device"] = (batch, event)

    def _from_stored(self, host: dict) -> Batch:
        """The stored tensors on the device: FP8 dequantized here, the rest cast to the step's
        dtype."""
        g = {
            k: (v.to(self.device, non_blocking=True) if isinstance(v, torch.Tensor) else v)
            for k, v in host.items()
        }
        states = {}
        for name in ("aux", "last"):
            # as fp8.dequantize, then the reader's bf16, then the step's dtype
            if f"{name}_fp8" in g:
                states[name] = dequantize(g[f"{name}_fp8"], g[f"{name}_scale"], self.dtype)
            else:
                states[name] = g[name].to(self.dtype)
        return Batch(g["ids"], g["loss_mask"], states["aux"], states["last"], host["sample_ids"])

    # -------------------------------------------------------------- the workers

    def _work(self) -> None:
        if self.cuda and self.device.index is not None:
            torch.cuda.set_device(self.device)  # page-locked memory is allocated for this device
        while True:
            try:  # a timed wait: a worker ends once the loader stops, even if its None never comes
                slot = self._jobs.get(timeout=STOP_POLL_S)
            except queue.Empty:
                if self._stop.is_set():
                    return
                continue
            if slot is None:
                return
            fut = slot["host"]
            if self._stop.is_set() or not fut.set_running_or_notify_cancel():
                continue
            try:
                fut.set_result(self.host_batch(slot["ids"]))
            except BaseException as e:  # noqa: BLE001 - handed to the main thread, which raises it
                fut.set_exception(e)

    def host_batch(self, ids: list[int]) -> Batch | dict:
        """One micro-batch in host memory (pinned on a GPU). For a GPU step the tensors as the
        shards store them, by name: plain shards' in their dtype, FP8 ones' as aux_fp8/aux_scale,
        last_fp8/last_scale; for a CPU step, or shards stored in several ways, already the Batch
        collate returns."""
        samples = [self.data.index[i] for i in ids]
        if len({self._stored_kind(r) for r, _ in samples}) > 1:
            return self._collated_on_host(ids)
        fp8 = samples[0][0].encoding == "fp8_e4m3"
        names = _stored_names(fp8, self.data.hidden_size, self.data.num_aux)
        pin = (
            self.cuda and torch.cuda.is_available()
        )  # (bench/loader.py times the GPU path's host work on a CPU)
        T = max(self.data.lengths[i] for i in ids)
        out, raw_ids, raw_mask = self._read_samples(samples, names, T, pin)
        out["ids"], out["loss_mask"] = raw_ids.long(), self._loss_mask(raw_mask, ids)
        if pin:
            out["ids"], out["loss_mask"] = out["ids"].pin_memory(), out["loss_mask"].pin_memory()
        if not self.cuda:  # a CPU step takes the batch as collate makes it
            for name in ("aux", "last"):
                out[name] = (
                    dequantize(out.pop(f"{name}_fp8"), out.pop(f"{name}_scale"), self.dtype)
                    if fp8
                    else out[name].to(self.dtype)
                )
            return Batch(out["ids"], out["loss_mask"], out["aux"], out["last"], list(ids))
        out["sample_ids"] = list(ids)
        return out

    def _stored_kind(self, reader) -> tuple[str, torch.dtype]:
        """How a shard stores hidden states: its encoding and the dtype of its aux tensor."""
        aux = "aux_hidden_states_fp8" if reader.encoding == "fp8_e4m3" else "aux_hidden_states"
        return reader.encoding, self._header(reader).tensors[aux].dtype

    def _collated_on_host(self, ids: list[int]) -> Batch:
        """A batch from shards stored in several ways: the reader's way (collate), on the host."""
        out = collate([self.data.sample(i) for i in ids], "cpu", self.dtype, ids=ids)
        return out.apply(torch.Tensor.pin_memory) if self.cuda else out

    def _read_samples(
        self, samples: list, names: dict[str, tuple[str, int]], T: int, pin: bool
    ) -> tuple[dict, torch.Tensor, torch.Tensor]:
        """The samples' stored tensors, padded with zeros to T rows: the hidden-state buffers
        (names: key -> (tensor name, width)), input ids and loss mask."""
        B = len(samples)
        header0 = self._header(samples[0][0])
        out = {
            k: self.empty(
                (B, T, w), dtype=_buffer_dtype(header0.tensors[name].dtype), pin_memory=pin
            )
            for k, (name, w) in names.items()
        }
        raw_ids, raw_mask = (
            torch.zeros(B, T, dtype=torch.int32),
            torch.zeros(B, T, dtype=torch.uint8),
        )
        for b, (r, j) in enumerate(samples):
            a, e = int(r.offsets[j]), int(r.offsets[j + 1])
            n, header = e - a, self._header(r)
            fd = os.open(r.path, os.O_RDONLY)
            try:
                for k, (name, _) in names.items():
                    self._read(fd, header, name, a, out[k][b, :n])
                    out[k][b, n:] = 0
                self._read(fd, header, "input_ids", a, raw_ids[b, :n])
                self._read(fd, header, "loss_mask", a, raw_mask[b, :n])
            finally:
                os.close(fd)
        return out, raw_ids, raw_mask

    def _loss_mask(self, raw_mask: torch.Tensor, ids: list[int]) -> torch.Tensor:
        mask = raw_mask.bool()
        if self.data.all_positions:  # every real token scored (ShardData.sample's rule)
            mask = torch.zeros_like(mask)
            for b, i in enumerate(ids):
                mask[b, : self.data.lengths[i]] = True
        return mask

    def _header(self, reader) -> Header:
        """The shard's header, read once per shard (ShardError naming the file if malformed)."""
        header = self._headers.get(reader.path)
        if header is None:
            try:
                header = self._headers[reader.path] = read_header(reader.path)
            except HeaderError as e:
                raise ShardError(str(e)) from e
        return header

    def _read(self, fd: int, header: Header, name: str, row: int, dst: torch.Tensor) -> None:
        """Rows row.. of tensor `name` into dst (contiguous), in chunks; the GIL is free while
        reading."""
        offset, row_bytes = header.tensors[name].start, header.tensors[name].row_bytes
        view = (
            memoryview(dst.view(torch.uint8).numpy()).cast("B") if dst.numel() else memoryview(b"")
        )
        pos, end = offset + row * row_bytes, len(view)
        if end != dst.shape[0] * row_bytes:
            raise InvalidInput(f"{name}: {end} bytes for {dst.shape[0]} rows of {row_bytes}")
        done = 0
        while done < end:
            if self._stop.is_set():
                raise _Stopped()
            got = os.preadv(fd, [view[done : done + READ_CHUNK]], pos + done)
            if got <= 0:
                raise OSError(f"{name}: short read at byte {pos + done} (the shard is truncated?)")
            done += got
        with self._lock:
            self.read_bytes += end

    # -------------------------------------------------------------- closing

    def close(self) -> None:
        """Stop and join the workers (pending reads dropped; a read in progress stops at its next
        chunk)."""
        self._stop.set()
        for _, slots in self._pending:
            for s in slots:
                s["host"].cancel()
        self._pending.clear()
        for _ in self._threads:
            self._jobs.put(None)
        for t in self._threads:
            t.join()
        if self._stream is not None:
            self._stream.synchronize()  # no copy left running into memory about to be freed

    def __enter__(self) -> "BatchLoader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _stored_names(fp8: bool, H: int, K: int) -> dict[str, tuple[str, int]]:
    """The batch's hidden-state keys -> (the shard's tensor name, width) for an encoding."""
    if fp8:
        return {
            "aux_fp8": ("aux_hidden_states_fp8", K * H),
            "aux_scale": ("aux_hidden_states_scale", K),
            "last_fp8": ("last_hidden_state_fp8", H),
            "last_scale": ("last_hidden_state_scale", 1),
        }
    return {"aux": ("aux_hidden_states", K * H), "last": ("last_hidden_state", H)}


def _buffer_dtype(stored: torch.dtype) -> torch.dtype:
    """A host buffer's dtype for a stored one: FP8 travels as its bytes (dequantize views them as
    e4m3)."""
    return torch.uint8 if stored == torch.float8_e4m3fn else stored


def dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """(B, T, G*W) e4m3 and (B, T, G) scales -> (B, T, G*W) dtype, one sequence at a time (bounded
    float32 transient): fp8.dequantize's arithmetic, then bf16 (ShardReader's dtype), then dtype."""
    B, T, width = q.shape
    G = scale.shape[-1]
    out = torch.empty(B, T, width, dtype=dtype, device=q.device)
    for b in range(B):
        x = q[b].view(torch.float8_e4m3fn).to(torch.float32).view(T, G, width // G) * scale[
            b
        ].float().unsqueeze(-1)
        out[b] = x.view(T, width).to(torch.bfloat16)
    return out


def threads_left() -> list[str]:
    """Names of loader threads still alive in this process (tests: none after a loader closed)."""
    return [
        t.name for t in threading.enumerate() if t.name.startswith(THREAD_PREFIX) and t.is_alive()
    ]
