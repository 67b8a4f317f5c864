"""The Swap copy path at the torch level: layouts, per-step budgets, cancel, host memory (no engine)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from marsched.vllm.kv_copy import KvMover
from marsched.vllm.kv_copy_layout import PROBE_BLOCKS, BlockLayout, LayoutError, probe_block_dim, resolve_layout
from marsched.vllm.kv_copy_plan import Cancelled, OutPlanner, blocks_per_step, check_budget

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(),
                                                                 reason="no CUDA device on this machine"))]
BLOCKS, HEADS, TOKENS, HEAD = 12, 2, 4, 8


def physical(logical_shape: tuple[int, ...], stride_order: tuple[int, ...], device: str) -> torch.Tensor:
    """A tensor of `logical_shape` whose memory is laid out in `stride_order` (outermost first), as
    vLLM allocates a backend's KV cache: physical shape in that order, permuted back to logical."""
    phys = torch.randn([logical_shape[d] for d in stride_order], device=device)
    inverse = [stride_order.index(d) for d in range(len(stride_order))]
    return phys.permute(*inverse)


class FlashLike:
    """A backend describing its logical shape the old way: K/V first, then blocks."""

    @staticmethod
    def get_kv_cache_shape(num_blocks, block_size, num_kv_heads, head_size, cache_dtype_str="auto"):
        return (2, num_blocks, block_size, num_kv_heads, head_size)


class BlocksThenKv:
    @staticmethod
    def get_kv_cache_shape(num_blocks, block_size, num_kv_heads, head_size, cache_dtype_str="auto"):
        return (num_blocks, 2, block_size, num_kv_heads, head_size)


# name: (logical shape, stride order, backend, expected block dim, kernel blocks per block)
LAYOUTS = {
    "vllm-view-LBHNC": ((BLOCKS, HEADS, TOKENS, 2 * HEAD), (0, 1, 2, 3), None, 0, 1),
    "vllm-view-LBNHC": ((BLOCKS, HEADS, TOKENS, 2 * HEAD), (0, 2, 1, 3), None, 0, 1),
    "vllm-view-LHBNC": ((BLOCKS, HEADS, TOKENS, 2 * HEAD), (1, 0, 2, 3), None, 0, 1),
    "vllm-view-kernel-blocks": ((BLOCKS * 2, HEADS, TOKENS // 2, 2 * HEAD), (0, 1, 2, 3), None, 0, 2),
    "kv-split-NHD": ((2, BLOCKS, TOKENS, HEADS, HEAD), (0, 1, 2, 3, 4), FlashLike, 1, 1),
    "kv-split-HND": ((2, BLOCKS, TOKENS, HEADS, HEAD), (0, 1, 3, 2, 4), FlashLike, 1, 1),
    "kv-split-blocks-outermost": ((2, BLOCKS, TOKENS, HEADS, HEAD), (1, 0, 2, 3, 4), FlashLike, 1, 1),
    "blocks-then-kv": ((BLOCKS, 2, TOKENS, HEADS, HEAD), (0, 1, 2, 3, 4), BlocksThenKv, 0, 1),
}


def caches_for(layout: str, device: str, layers: int = 3) -> tuple[dict[str, torch.Tensor], dict[str, BlockLayout]]:
    shape, order, backend, _, _ = LAYOUTS[layout]
    caches = {f"layer{i}": physical(shape, order, device) for i in range(layers)}
    return caches, {name: resolve_layout(name, kv, BLOCKS, backend) for name, kv in caches.items()}


def blocks(kv: torch.Tensor, layout: BlockLayout, ids: list[int]) -> torch.Tensor:
    return layout.blocks_view(kv)[ids].clone()


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_layout_is_read_not_guessed(layout):
    shape, order, backend, block_dim, kernel = LAYOUTS[layout]
    found = resolve_layout("layer0", physical(shape, order, "cpu"), BLOCKS, backend)
    assert (found.block_dim, found.kernel_blocks) == (block_dim, kernel)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_round_trip_restores_block_contents(layout, device):
    caches, layouts = caches_for(layout, device)
    mover = KvMover(caches, layouts)
    src, dst = [7, 2, 9], [1, 11, 4]
    others = [b for b in range(BLOCKS) if b not in src + dst]
    saved = {n: blocks(kv, layouts[n], src) for n, kv in caches.items()}
    before = {n: blocks(kv, layouts[n], others) for n, kv in caches.items()}
    mover.copy_out("r", src)
    for name, kv in caches.items():  # the blocks are freed and reused by someone else
        layouts[name].blocks_view(kv)[src] = 0.0
    mover.copy_in("r", dst)
    mover.end_step()
    for name, kv in caches.items():
        assert torch.equal(blocks(kv, layouts[name], dst), saved[name]), name
        assert torch.equal(blocks(kv, layouts[name], others), before[name]), name
    assert mover.host == {} and not mover.in_flight


@pytest.mark.parametrize("device", DEVICES)
def test_restore_from_a_later_block_of_the_copy(device):
    """A local prefix hit covers the first saved blocks: only the rest is written back."""
    caches, layouts = caches_for("vllm-view-LBHNC", device)
    mover = KvMover(caches, layouts)
    saved = {n: blocks(kv, layouts[n], [3, 5, 6]) for n, kv in caches.items()}
    mover.copy_out("r", [3, 5, 6])
    mover.copy_in("r", [10, 0], first=1)
    mover.end_step()
    for name, kv in caches.items():
        assert torch.equal(blocks(kv, layouts[name], [10, 0]), saved[name][1:])


@pytest.mark.parametrize("device", DEVICES)
def test_a_dimension_as_large_as_the_block_count_does_not_fool_it(device):
    """Two blocks in a K/V-first cache: dimension 0 (K/V) has the block count's size too."""
    kv = physical((2, 2, TOKENS, HEADS, HEAD), (0, 1, 3, 2, 4), device)
    layout = resolve_layout("l0", kv, 2, FlashLike)
    assert layout.block_dim == 1
    mover = KvMover({"l0": kv}, {"l0": layout})
    keys, values = kv[0, 0].clone(), kv[1, 0].clone()
    mover.copy_out("r", [0])
    mover.copy_in("r", [1])
    mover.end_step()
    assert torch.equal(kv[0, 1], keys) and torch.equal(kv[1, 1], values)


def test_a_block_split_into_kernel_blocks_moves_whole():
    """The backend splits each manager block into two kernel blocks: block b is entries 2b, 2b + 1."""
    caches, layouts = caches_for("vllm-view-kernel-blocks", "cpu", layers=1)
    kv = caches["layer0"]
    saved = kv[[6, 7]].clone()  # manager block 3
    mover = KvMover(caches, layouts)
    mover.copy_out("r", [3])
    mover.copy_in("r", [10])
    assert torch.equal(kv[[20, 21]], saved)


def test_layout_errors_name_the_layer():
    with pytest.raises(LayoutError, match="'model.layers.3.attn'.*which dimension holds blocks"):
        resolve_layout("model.layers.3.attn", torch.zeros(4096, dtype=torch.int8), BLOCKS)  # a flat buffer
    with pytest.raises(LayoutError, match="'l0'.*13 entries, not a multiple of the engine's 12 blocks"):
        resolve_layout("l0", torch.zeros(13, HEADS, TOKENS, HEAD), BLOCKS)
    with pytest.raises(LayoutError, match="'l0'.*number of blocks is unknown"):
        resolve_layout("l0", torch.zeros(BLOCKS, HEADS, TOKENS, HEAD), None)
    # The backend's shape has the tensor's rank but its block dimension does not fit this tensor.
    with pytest.raises(LayoutError, match="'l0'.*dimension 1 .*get_kv_cache_shape"):
        resolve_layout("l0", torch.zeros(2, 5, TOKENS, HEADS, HEAD), BLOCKS, FlashLike)


def test_probe_needs_one_dimension_moving_with_the_block_count():
    assert probe_block_dim(FlashLike.get_kv_cache_shape) == (1, 5)
    assert probe_block_dim(lambda nb, bs, h, d: (nb, nb, bs)) is None  # ambiguous
    assert probe_block_dim(lambda nb, bs, h, d: (bs, h, d)) is None  # no block dimension

    def refuses(*args):
        raise NotImplementedError

    assert probe_block_dim(refuses) is None
    assert PROBE_BLOCKS not in (2, 16, 8, 256)


@pytest.mark.parametrize("device", DEVICES)
def test_host_memory_is_pinned_only_on_cuda(device):
    caches, layouts = caches_for("vllm-view-LBHNC", device)
    mover = KvMover(caches, layouts)
    mover.copy_out("r", [0, 1])
    copy = mover.host["r"]
    assert all(t.device.type == "cpu" for t in copy.blocks.values())
    assert copy.pinned == (device == "cuda")
    assert mover.host_bytes == 3 * 2 * HEADS * TOKENS * 2 * HEAD * 4


def test_budget_cuts_a_copy_into_steps_first_come_first_served():
    planner = OutPlanner(3)
    planner.queue("a", list(range(10, 17)))  # 7 blocks
    planner.queue("b", [1, 2])
    steps = []
    while planner:
        steps.append([(c.key, c.first, c.block_ids, c.last) for c in planner.take_step()])
    assert steps == [[("a", 0, (10, 11, 12), False)],
                     [("a", 3, (13, 14, 15), False)],
                     [("a", 6, (16,), True), ("b", 0, (1, 2), True)]]


def test_no_budget_sends_every_copy_whole_in_one_step():
    planner = OutPlanner(None)
    planner.queue("a", list(range(100)))
    planner.queue("b", [])
    chunks = planner.take_step()
    assert [(c.key, len(c.block_ids), c.last) for c in chunks] == [("a", 100, True), ("b", 0, True)]
    assert not planner and planner.take_step() == []


def test_budget_values():
    assert blocks_per_step(None, None, 100) is None
    assert blocks_per_step(8, None, 100) == 8
    assert blocks_per_step(8, 350, 100) == 3
    assert blocks_per_step(None, 50, 100) == 1  # never less than one block: a copy always moves
    for bad in (0, -1, 2.5, True, "4"):
        with pytest.raises(ValueError, match="swap_blocks_per_step: give a whole number"):
            check_budget(bad, "swap_blocks_per_step")


@pytest.mark.parametrize("device", DEVICES)
def test_copy_larger_than_the_budget_lands_over_several_steps_intact(device):
    caches, layouts = caches_for("kv-split-HND", device)
    mover = KvMover(caches, layouts)
    planner = OutPlanner(2)
    src = [11, 0, 5, 3, 8]
    saved = {n: blocks(kv, layouts[n], src) for n, kv in caches.items()}
    planner.queue("r", src)
    sizes = []
    while planner:
        chunks = planner.take_step()
        for chunk in chunks:
            mover.copy_out(chunk.key, chunk.block_ids, chunk.first, chunk.total)
            sizes.append(len(chunk.block_ids))
        assert mover.host["r"].complete == chunks[-1].last
        mover.end_step()
    assert sizes == [2, 2, 1]
    for transfer in list(mover.in_flight):
        mover.wait(transfer)
    assert mover.stats["out_blocks"] == 5 and not mover.in_flight
    for name, kv in caches.items():
        layouts[name].blocks_view(kv)[src] = 0.0
    mover.copy_in("r", [1, 2, 4, 6, 7])
    mover.end_step()
    for name, kv in caches.items():
        assert torch.equal(blocks(kv, layouts[name], [1, 2, 4, 6, 7]), saved[name])
    for transfer in list(mover.in_flight):
        mover.wait(transfer)
    assert mover.host == {} and mover.host_bytes == 0 and not mover.in_flight
    assert mover.stats["in_blocks"] == 5


@pytest.mark.parametrize("device", DEVICES)
def test_cancel_mid_transfer_frees_the_host_copy(device):
    caches, layouts = caches_for("vllm-view-LBHNC", device)
    mover = KvMover(caches, layouts)
    planner = OutPlanner(2)
    planner.queue("r", [1, 2, 3, 4, 5])
    chunk = planner.take_step()[0]
    mover.copy_out(chunk.key, chunk.block_ids, chunk.first, chunk.total)
    assert mover.host_bytes > 0 and not mover.host["r"].complete
    assert planner.cancel("r") is Cancelled.PARTIAL
    mover.drop("r")
    mover.end_step()
    for transfer in list(mover.in_flight):
        mover.wait(transfer)
    assert mover.host == {} and mover.host_bytes == 0 and not mover.in_flight and not planner
    assert planner.cancel("r") is Cancelled.NOTHING
    planner.queue("s", [1])
    assert planner.cancel("s") is Cancelled.UNSENT


def test_chunks_must_follow_in_order():
    caches, layouts = caches_for("vllm-view-LBHNC", "cpu")
    mover = KvMover(caches, layouts)
    mover.copy_out("r", [1, 2], 0, 4)
    with pytest.raises(ValueError, match="copy out of 'r': chunk of blocks 3..3 of 4 does not follow"):
        mover.copy_out("r", [3], 3, 4)
    with pytest.raises(ValueError, match="copy in of 'r': .*2 of 4 blocks"):
        mover.copy_in("r", [5])
    with pytest.raises(ValueError, match="copy in of 'q': .*no host copy"):
        mover.copy_in("q", [5])


def test_layers_sharing_one_tensor_are_copied_once():
    kv = torch.randn(BLOCKS, HEADS, TOKENS, 2 * HEAD)
    layouts = dict.fromkeys(("a", "b"), BlockLayout(0))
    mover = KvMover({"a": kv, "b": kv}, layouts)
    mover.copy_out("r", [0])
    assert list(mover.host["r"].blocks) == ["a"]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device on this machine")
def test_cuda_copies_never_synchronize_the_device(monkeypatch):
    def forbidden(*args, **kwargs):
        raise AssertionError("torch.cuda.synchronize called on the copy path")

    monkeypatch.setattr(torch.cuda, "synchronize", forbidden)
    caches, layouts = caches_for("kv-split-HND", "cuda")
    mover = KvMover(caches, layouts)
    baseline = torch.cuda.memory_allocated()
    mover.copy_out("r", [1, 2, 3])
    mover.end_step()
    mover.copy_in("r", [4, 5, 6])
    mover.end_step()
    torch.cuda.current_stream().synchronize()
    mover.poll()
    assert not mover.in_flight and mover.stats["out_s"] > 0 and mover.stats["in_s"] > 0
    assert torch.cuda.memory_allocated() <= baseline  # staging buffers went back


# --- the connector's use of it (scheduler and worker side, no engine) ---------------------


def connector(role: str, budget: dict | None = None, caches: dict | None = None):
    pytest.importorskip("vllm")
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from marsched.vllm.kv_swap import HostSwapConnector

    spec = SimpleNamespace(page_size_bytes=HEADS * TOKENS * 2 * HEAD * 4)
    config = SimpleNamespace(cache_config=SimpleNamespace(block_size=TOKENS),
                             kv_transfer_config=SimpleNamespace(kv_connector_extra_config=budget or {}))
    kv_config = SimpleNamespace(num_blocks=BLOCKS, kv_cache_groups=[SimpleNamespace(
        kv_cache_spec=spec, layer_names=list(caches or ["layer0", "layer1", "layer2"]))])
    made = HostSwapConnector(config, getattr(KVConnectorRole, role), kv_config)
    if caches is not None:
        made.register_kv_caches(caches)
    return made


def run_worker_step(worker, meta) -> None:
    worker.bind_connector_metadata(meta)
    worker.start_load_kv(None)
    worker.wait_for_save()
    worker.clear_connector_metadata()


def test_connector_without_budget_sends_the_whole_copy_in_the_next_step():
    sched = connector("SCHEDULER")
    sched.queue_swap_out("r", [3, 4, 5], 10)
    meta = sched.build_connector_meta(None)
    assert meta.swap_out == [("r", [3, 4, 5])] and [c.block_ids for c in meta.out_chunks] == [(3, 4, 5)]
    assert not sched.has_pending_push_work() and not sched.cancel_swap_out("r")


def test_connector_budget_tells_the_scheduler_only_in_the_last_chunk_step():
    sched = connector("SCHEDULER", {"swap_bytes_per_step": 2 * 3 * HEADS * TOKENS * 2 * HEAD * 4})  # 2 blocks
    caches, _ = caches_for("vllm-view-LBHNC", "cpu")
    worker = connector("WORKER", caches=caches)
    saved = {n: kv[[3, 4, 5, 6, 7]].clone() for n, kv in caches.items()}
    assert sched.blocks_per_step == 2
    sched.queue_swap_out("r", [3, 4, 5, 6, 7], 20)
    told = []
    while sched.has_pending_push_work():
        meta = sched.build_connector_meta(None)
        told.append(meta.swap_out)
        run_worker_step(worker, meta)
    assert told == [[], [], [("r", [3, 4, 5, 6, 7])]]
    assert sched.host_tokens_used == 20 and worker.host_bytes > 0
    for kv in caches.values():
        kv[[3, 4, 5, 6, 7]] = 0.0
    sched.expect_load["r"] = 20
    request = SimpleNamespace(request_id="r")
    assert sched.get_num_new_matched_tokens(request, 0) == (20, False)
    sched.update_state_after_alloc(request, SimpleNamespace(get_block_ids=lambda: ([0, 1, 2, 8, 9],)), 20)
    run_worker_step(worker, sched.build_connector_meta(None))
    for name, kv in caches.items():
        assert torch.equal(kv[[0, 1, 2, 8, 9]], saved[name])
    assert worker.host_bytes == 0 and worker.stats["in_blocks"] == 5 and sched.host_tokens_used == 0


def test_connector_cancel_mid_copy_drops_the_workers_part():
    sched = connector("SCHEDULER", {"swap_blocks_per_step": 2})
    caches, _ = caches_for("vllm-view-LBHNC", "cpu")
    worker = connector("WORKER", caches=caches)
    sched.queue_swap_out("r", [1, 2, 3], 12)
    run_worker_step(worker, sched.build_connector_meta(None))
    assert sorted(worker.host) == ["r"] and sched.has_pending_push_work()
    assert sched.cancel_swap_out("r")  # the request came back before the copy was sent whole
    meta = sched.build_connector_meta(None)
    assert meta.drop == ["r"] and meta.swap_out == [] and meta.out_chunks == []
    run_worker_step(worker, meta)
    assert worker.host == {} and worker.host_bytes == 0 and sched.host_tokens_used == 0
    assert not sched.has_pending_push_work()


def test_connector_refuses_a_bad_budget():
    with pytest.raises(ValueError, match="kv_connector_extra_config.swap_blocks_per_step"):
        connector("SCHEDULER", {"swap_blocks_per_step": 0})
