"""GPU/CPU split FFN: resident neurons' rows live in fixed device slots, the rest are read from the mapped file.

Per decode step and layer: the predictor (on the device) selects neurons; selected resident ones are computed
on the device while a CPU thread computes the others, and the two disjoint partial sums are added. With the
dynamic schedule the split moves per step (split_cost.balance) and a neuron cache (neuron_cache.NeuronCache)
promotes neurons hot for this prompt into device slots. On a CUDA device the device's share runs in the hot-FFN
kernels (kernels/hot_ffn.py), which select among the slots themselves, with one host wait per layer; there the
dynamic schedule keeps the split fixed within a step and only promotes, copying the new neurons' rows on a side
stream between steps into the slots the kernels (and a step's CUDA graphs) already read, which the layer's next
device work waits for. The device may be "cpu": a second tensor set that simulates the GPU side, for tests and for
machines without one.
"""

from __future__ import annotations

import importlib.util
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace

import torch
from gguf import GGMLQuantizationType

from qinfer.core.architectures import FfnForm
from qinfer.core.errors import UserError
from qinfer.runtime.ffn.neuron_cache import CachePolicy, NeuronCache
from qinfer.runtime.ffn.sparse import (
    FFNWeights,
    activations,
    active_ids,
    gate_mask,
    kernel_ffn,
    predicted_mask,
    predictor_scores,
    selected_rows,
    sparse_rows,
)
from qinfer.runtime.ffn.split_cost import SplitCosts, balance
from qinfer.runtime.kernels.quant_rows import QuantizedMatrix, Weight
from qinfer.runtime.kernels.weight_rows import gather_rows, rows_to, weighted_row_sum


def empty_rows(t: Weight, capacity: int, device: torch.device) -> Weight:
    """Zeroed rows for `capacity` neurons: zero blocks (scale 0) expand to zeros, so empty slots add nothing."""
    if isinstance(t, QuantizedMatrix):
        return t.like(torch.zeros(capacity, t.blocks.shape[1], dtype=torch.uint8, device=device))
    return torch.zeros(capacity, t.shape[1], dtype=t.dtype, device=device)


def rows_on(t: Weight, ids: torch.Tensor, device: torch.device) -> Weight:
    """Rows `ids` on `device`; quantized rows travel as their blocks and are expanded only where they are used."""
    return t.raw_rows(ids, device) if isinstance(t, QuantizedMatrix) else rows_to(t, ids, device)


def weight_bytes(t: Weight | None) -> int:
    """Bytes a weight really occupies: raw blocks for a quantized one."""
    if t is None:
        return 0
    return t.nbytes if isinstance(t, QuantizedMatrix) else t.numel() * t.element_size()


@dataclass
class DeviceSlots:
    """One layer's device-resident rows: [capacity, E] per matrix (raw blocks when the file is quantized)."""

    up: Weight
    down_t: Weight
    gate: Weight | None
    fc1: Weight | None
    fc2: Weight | None

    @classmethod
    def allocate(cls, w: FFNWeights, capacity: int, device: torch.device, predictors: bool) -> DeviceSlots:
        """`predictors`: whether fc1/fc2 go to the device too."""

        def empty(t: Weight | None) -> Weight | None:
            return None if t is None else empty_rows(t, capacity, device)

        def whole(t: Weight | None) -> Weight | None:
            return None if t is None else t.to(device)

        up, down_t = empty_rows(w.up, capacity, device), empty_rows(w.down_t, capacity, device)
        # On the device the predictors stay whole and still quantized, as the planner budgets them.
        fc1, fc2 = (whole(w.fc1), whole(w.fc2)) if predictors else (None, None)
        return cls(up, down_t, empty(w.gate), fc1, fc2)

    def load(self, w: FFNWeights, slots: torch.Tensor, neurons: torch.Tensor, staged: bool = False) -> None:
        """Copy neurons' rows from the mapped weights into `slots`; `staged`: the rows through pinned memory, queued
        on the current stream without waiting (a GPU's side stream, with `slots` already on the device)."""
        if slots.numel() == 0:
            return
        device_slots = slots.to(self.up.device)
        for mine, source in ((self.up, w.up), (self.down_t, w.down_t), (self.gate, w.gate)):
            if mine is None or source is None:
                continue
            rows = _staged_rows(source, neurons, mine.device) if staged else rows_on(source, neurons, mine.device)
            if isinstance(mine, QuantizedMatrix) and isinstance(rows, QuantizedMatrix):
                mine.blocks[device_slots] = rows.blocks
            else:
                mine[device_slots] = rows

    def dense(self, form: FfnForm, x: torch.Tensor) -> torch.Tensor:
        """The FFN over every slot (prefill); quantized slots are expanded a chunk of rows at a time."""
        if self.up.shape[0] == 0:  # a layer the plan gave no GPU neuron
            return torch.zeros(x.shape[0], self.down_t.shape[1], device=x.device)
        if not isinstance(self.up, QuantizedMatrix):
            return weighted_row_sum(activations(form, x, self.gate, self.up), self.down_t)
        # Chunks of rows, so the expanded transient stays inside the planner's scratch reserve.
        capacity, step = self.up.shape[0], self.up.chunk_rows()
        out = torch.zeros(x.shape[0], self.down_t.shape[1], device=x.device)
        for start in range(0, capacity, step):
            ids = torch.arange(start, min(start + step, capacity), device=x.device)
            out += sparse_rows(form, x, self.gate, self.up, self.down_t, ids, None)
        return out


@dataclass
class LayerSplit:
    """What one layer did in its last decode step: neurons computed on each side and moved between them."""

    device: int = 0
    cpu: int = 0
    # Torch's path: neurons the per-step balance moved to the other side; the kernels' path: neurons promoted into
    # device slots (for the layer's next step).
    moved: int = 0


def _staged_rows(t: Weight, ids: torch.Tensor, device: torch.device) -> Weight:
    """`rows_on`, through pinned memory and without waiting for the copy."""
    if isinstance(t, QuantizedMatrix):
        return t.like(_to_device(t.blocks.index_select(0, ids), device))
    return _to_device(gather_rows(t, ids), device)


def _kernel_reads(t: Weight) -> bool:
    """Whether the hot-FFN kernels read these rows: float, or Q4_0 blocks."""
    return not isinstance(t, QuantizedMatrix) or t.qtype == GGMLQuantizationType.Q4_0


def host_buffer(shape: torch.Size | tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A host buffer that `device` copies to and from without waiting: pinned where that is a GPU, since a copy
    from pageable memory first waits for the GPU's queue to drain."""
    return torch.empty(shape, dtype=dtype, pin_memory=device.type == "cuda")


def _to_host(t: torch.Tensor) -> torch.Tensor:
    """A host copy of a device tensor, queued without waiting where the device is a GPU."""
    if t.device.type == "cpu":
        return t
    return host_buffer(t.shape, t.dtype, t.device).copy_(t, non_blocking=True)


def _to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`t` on `device`, queued without waiting where that is a GPU."""
    if device.type == "cpu":
        return t
    return host_buffer(t.shape, t.dtype, device).copy_(t).to(device, non_blocking=True)


def require_split_support(form: FfnForm) -> None:
    """Device slots hold FFN rows only, not per-neuron biases: such a model is refused before anything is planned."""
    if form.biased:
        raise UserError("the GPU/CPU split does not take FFNs with biases (opt) yet; run without --vram-budget")


class HybridRunner:
    def __init__(
        self,
        layers: list[FFNWeights],
        threshold: float,
        device: torch.device,
        resident: list[torch.Tensor],
        capacity: list[int],
        device_predictors: list[bool],
        costs: SplitCosts,
        dynamic: bool,
        policy: CachePolicy | None = None,
        in_kernel: bool | None = None,
    ):
        """`in_kernel`: the device side selects and computes its neurons in the hot-FFN kernels (kernels/hot_ffn.py)
        rather than in torch ops over a host list of ids; None: where it can, on a CUDA device.
        `device_predictors`: per layer, whether its predictor goes to the device (the plan's
        `Placement.predictor_on_gpu`, which budgeted it)."""
        require_split_support(layers[0].form)
        self.layers = layers
        self.threshold = threshold
        self.device = device
        self.dynamic = dynamic
        self.costs = costs
        # Static placement keeps exactly the planned neurons; only the dynamic schedule fills spare slots.
        caps = capacity if dynamic else [int(r.numel()) for r in resident]
        policy = policy or CachePolicy()
        self.caches = [NeuronCache(w.neurons, c, r, policy) for w, c, r in zip(layers, caps, resident, strict=True)]
        self.slots = []
        for w, cache, predictor in zip(layers, self.caches, device_predictors, strict=True):
            slots = DeviceSlots.allocate(w, cache.capacity, device, predictors=predictor)
            used = torch.nonzero(cache.slot_neuron >= 0).flatten()
            slots.load(w, used, cache.slot_neuron[used])
            self.slots.append(slots)
        self.last = [LayerSplit() for _ in layers]
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="qinfer-cpu-ffn")
        kernel_rows = all(_kernel_reads(t) for s in self.slots for t in (s.up, s.down_t, s.gate) if t is not None)
        if in_kernel is None:
            # The simulated device keeps torch's ops unless asked (the tests run the kernels in Triton's interpreter);
            # so does a CUDA build of torch that came without triton.
            has_triton = importlib.util.find_spec("triton") is not None
            in_kernel = device.type == "cuda" and has_triton and kernel_rows
        elif in_kernel and not kernel_rows:
            raise ValueError("the hot-FFN kernels read float or Q4_0 rows")
        self.in_kernel = in_kernel
        # Per layer: which neuron each slot holds, on the device, and which neurons are resident, on the host.
        self.slot_neuron = [cache.slot_neuron.to(device, torch.int32) for cache in self.caches]
        self.resident = [cache.neuron_slot >= 0 for cache in self.caches]
        # The kernel path's promotions: per layer, (slots, neurons) chosen but not yet copied, and the event their
        # copy recorded, which the layer's next device work waits for.
        self.pending: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._promoted: dict[int, torch.cuda.Event] = {}
        self._side = torch.cuda.Stream(device) if device.type == "cuda" else None

    def device_bytes(self) -> int:
        """Bytes of neuron rows held on the device (slots, empty ones included)."""
        return sum(weight_bytes(s.up) + weight_bytes(s.down_t) + weight_bytes(s.gate) for s in self.slots)

    def predictor_bytes(self) -> int:
        """Bytes of the predictors held on the device."""
        return sum(weight_bytes(s.fc1) + weight_bytes(s.fc2) for s in self.slots)

    def __call__(self, layer: int, x: torch.Tensor, h: torch.Tensor, prefill: bool) -> torch.Tensor:
        """x and h may live on the CPU (dense parts there) or on the device; the result goes where x is."""
        self.promote(layer)
        self.await_promoted(layer)
        x_dev, h_dev = x.to(self.device), h.to(self.device)
        out = self._prefill(layer, x_dev) if prefill else self._decode(layer, x_dev, h_dev)
        return out.to(x.device)

    def _prefill(self, layer: int, x: torch.Tensor) -> torch.Tensor:
        """Every neuron for every token: the device over its slots, densely; the CPU over the neurons not in them,
        in the row kernel, which skips a token's up and down rows where its gate does not fire (rows it does not
        take: every row, the resident neurons' activations zeroed)."""
        w, s, resident = self.layers[layer], self.slots[layer], self.resident[layer]
        x_cpu = x.cpu()

        def cpu_part() -> torch.Tensor:
            out = kernel_ffn(w, x_cpu, torch.nonzero(~resident).flatten())
            if out is not None:
                return out
            act = activations(w.form, x_cpu, w.gate, w.up)
            act[:, resident] = 0
            return weighted_row_sum(act, w.down_t)

        # The CPU part runs on the thread that does the host's decode work. On another, it would leave an idle
        # OpenMP team beside that thread's, and where the two teams outnumber the cores their barriers sleep: the
        # kernels' host part of a layer took 84 us instead of 42 after a prompt (7b-slice, 50 neurons, 2 threads).
        if self.in_kernel:
            on_device = s.dense(w.form, x)  # queued first: the device computes it meanwhile
            return on_device + cpu_part().to(self.device)
        future = self.pool.submit(cpu_part)
        return s.dense(w.form, x) + future.result().to(self.device)

    def cold(self, layer: int) -> bool:
        """Whether some of the layer's neurons live on the host alone, so that its decode step has a host part."""
        return not bool(self.resident[layer].all())

    def device_scores(self, layer: int, h: torch.Tensor) -> torch.Tensor | None:
        """The predictor's scores [T, F] on the device, where the layer has one there (None: a calibrated model,
        which its gate selects, or a layer whose predictor stays on the host: `device_predictors`)."""
        w, s = self.layers[layer], self.slots[layer]
        if not w.has_predictor or s.fc1 is None:
            return None
        return predictor_scores(replace(w, fc1=s.fc1, fc2=s.fc2), h)

    def device_selects(self, layer: int) -> bool:
        """Whether the device can select among the layer's slots: by its predictor there, or by a calibrated model's
        gate. A layer whose predictor stays on the host gets no spare slots from the loader; given some, the kernels'
        path leaves them empty, while torch's selects on the host."""
        return not self.layers[layer].has_predictor or self.slots[layer].fc1 is not None

    def device_ffn(self, layer: int, x: torch.Tensor, scores: torch.Tensor | None) -> torch.Tensor:
        """The selected resident neurons' sum [T, E], selected and computed inside the hot-FFN kernels."""
        from qinfer.runtime.kernels.hot_ffn import Select, hot_ffn

        w, s = self.layers[layer], self.slots[layer]
        if not self.device_selects(layer):
            return torch.zeros(x.shape[0], w.down_t.shape[1], device=x.device)
        select = Select.PREDICTOR if scores is not None else Select.GATE
        threshold = self.threshold if scores is not None else w.gate_threshold
        return hot_ffn(w.form, x, s.gate, s.up, s.down_t, self.slot_neuron[layer], select, threshold, scores)

    def host_reads(
        self, layer: int, x: torch.Tensor, h: torch.Tensor, scores: torch.Tensor | None
    ) -> list[torch.Tensor | None]:
        """What `host_ffn` reads, made on the device: the FFN's input, the predictor's selection (None: the host
        selects) and h where the host runs the predictor."""
        picked = None if scores is None else scores >= self.threshold
        return [x, picked, h if scores is None and self.layers[layer].has_predictor else None]

    def host_ffn(
        self, layer: int, x: torch.Tensor, picked: torch.Tensor | None, h: torch.Tensor | None
    ) -> torch.Tensor:
        """The selected neurons that are not resident, on the host (its row kernels), from `host_reads`' tensors
        copied there."""
        w = self.layers[layer]
        if picked is None:
            # A calibrated model's gate (over every row), or the predictor of a layer with no GPU rows.
            picked = gate_mask(w, x) if h is None else predicted_mask(w, h, self.threshold)
        out, cold, resident = selected_rows(w.form, x, w.gate, w.up, w.down_t, picked, self.resident[layer])
        self.last[layer] = LayerSplit(resident, cold, 0)
        # Where the device cannot select (device_selects), a neuron promoted there would be computed by neither side.
        if self.dynamic and self.device_selects(layer):
            self.last[layer].moved = self._choose_promotions(layer, picked.any(0))
        return out

    def _choose_promotions(self, layer: int, selected: torch.Tensor) -> int:
        """The neuron cache sees which neurons this step selected (bool [F]) and may choose swaps (how many it
        returns); the host counts them resident from the layer's next device work on, which waits for their rows
        (`promote`, `await_promoted`)."""
        cache = self.caches[layer]
        cache.observe(selected)
        if not cache.due():
            return 0
        slots, neurons = cache.rebalance()
        if slots.numel():
            self.pending[layer] = (slots, neurons)
            self.resident[layer] = cache.neuron_slot >= 0
        return int(slots.numel())

    def promote(self, layer: int) -> None:
        """Copy the layer's pending promotions into its slots: on a GPU, on a side stream behind all work queued so
        far (the step that read the old rows), with an event the layer's next device work waits for."""
        slots, neurons = self.pending.pop(layer, (None, None))
        if slots is None or neurons is None or slots.numel() == 0:
            return
        if self._side is None:
            self.slots[layer].load(self.layers[layer], slots, neurons)
            self.slot_neuron[layer][slots] = neurons.to(torch.int32)
            return
        self._side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self._side):
            where = _to_device(slots, self.device)
            self.slots[layer].load(self.layers[layer], where, neurons, staged=True)
            self.slot_neuron[layer][where] = _to_device(neurons.to(torch.int32), self.device)
            self._promoted[layer] = torch.cuda.Event()
            self._promoted[layer].record()

    def await_promoted(self, layer: int) -> None:
        """Make the current stream wait for the layer's last promotion copy (queued, not a host wait)."""
        event = self._promoted.pop(layer, None)
        if event is not None:
            torch.cuda.current_stream(self.device).wait_event(event)

    def _decode_in_kernel(self, layer: int, x: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        """The device selects among its slots inside the hot-FFN kernels while the host, after one wait for the
        selection and x, computes the other selected neurons in the CPU's row kernels."""
        scores = self.device_scores(layer, h)
        # Copies the host waits for, queued before the device's own FFN so that the two sides run together.
        reads = [None if t is None else _to_host(t) for t in self.host_reads(layer, x, h, scores)]
        ready = torch.cuda.Event() if x.device.type == "cuda" else None
        if ready is not None:
            ready.record()
        out = self.device_ffn(layer, x, scores)
        if ready is not None:
            ready.synchronize()
        return out + _to_device(self.host_ffn(layer, *reads), out.device)

    def _decode(self, layer: int, x: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        if self.in_kernel:
            return self._decode_in_kernel(layer, x, h)
        w, s, cache = self.layers[layer], self.slots[layer], self.caches[layer]
        batch = x.shape[0]
        if not w.has_predictor:
            # A calibrated model without predictors: its gate decides, over every row (the mapped ones, on the CPU).
            mask = gate_mask(w, x.cpu())
        elif s.fc1 is None:
            # The plan left this layer's predictor on the host: it selects there (the loader gives such a layer no
            # spare slots).
            mask = predicted_mask(w, h.cpu(), self.threshold)
        else:
            mask = predicted_mask(replace(w, fc1=s.fc1, fc2=s.fc2), h, self.threshold).cpu()
        ids = active_ids(mask)
        slot_of = cache.neuron_slot[ids]
        on_device = slot_of >= 0
        dev_pos, cpu_pos = torch.nonzero(on_device).flatten(), torch.nonzero(~on_device).flatten()
        move = balance(self.costs, dev_pos.numel(), cpu_pos.numel(), batch) if self.dynamic else 0
        shipped = cpu_pos[:move] if move > 0 else cpu_pos[:0]
        if move > 0:
            cpu_pos = cpu_pos[move:]
        elif move < 0:
            cpu_pos, dev_pos = torch.cat((cpu_pos, dev_pos[move:])), dev_pos[:move]

        def token_mask(pos: torch.Tensor) -> torch.Tensor | None:
            # One token: every selected neuron is selected for it.
            return mask[:, ids[pos]] if batch > 1 else None

        x_cpu = x.cpu()

        def cpu_part() -> torch.Tensor:
            started = time.perf_counter()
            out = sparse_rows(w.form, x_cpu, w.gate, w.up, w.down_t, ids[cpu_pos], token_mask(cpu_pos))
            self.costs.calibrate(cpu_pos.numel(), batch, time.perf_counter() - started)
            return out

        future = self.pool.submit(cpu_part)
        out = sparse_rows(w.form, x, s.gate, s.up, s.down_t, slot_of[dev_pos], token_mask(dev_pos))
        if shipped.numel():
            ship_ids = ids[shipped]
            gate = None if w.gate is None else rows_on(w.gate, ship_ids, self.device)
            up, down_t = rows_on(w.up, ship_ids, self.device), rows_on(w.down_t, ship_ids, self.device)
            all_rows = torch.arange(ship_ids.numel(), device=self.device)
            out = out + sparse_rows(w.form, x, gate, up, down_t, all_rows, token_mask(shipped))
        out = out + future.result().to(self.device)
        self.last[layer] = LayerSplit(int(dev_pos.numel()) + int(shipped.numel()), int(cpu_pos.numel()), move)
        if self.dynamic:
            self._choose_promotions(layer, mask.any(0))
            self.promote(layer)  # now (on a GPU's side stream, which the layer's next call waits for)
        return out
