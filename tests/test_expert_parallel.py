"""Expert parallelism moves experts between processes, never math: 2 and 4 gloo ranks on CPU, every family,
bit for bit the single-process resident model (logits, every hook, a re-routing hook, greedy generate),
and each rank reads only its own experts from the checkpoint. Ranks that diverge (hooks, batch, weights,
sampling, an exception caught on one rank) get an ExpertParallelError on every rank naming what differed,
and a rank that stalls one naming the timeout and the layer."""

import os
import socket
import time
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from safetensors.torch import load_file, save_file
from test_quantized_checkpoints import quantize_folder

import tiny
import tiny_deepseek_v3
import tiny_glm4_moe
import tiny_gpt_oss
import tiny_minimax_m2
import tiny_deepseek_v32
import tiny_glm_moe_dsa
import tiny_mixtral
import tiny_olmoe
import tiny_qwen3_moe
from moelens import HookedTransformer
from moelens.kernels import expert_parallel
from moelens.kernels.expert_parallel import ExpertParallelError, content_hash, expert_range
from moelens.loaders.errors import CheckpointWarning
from moelens.loaders.expert_reader import ExpertReader

pytestmark = pytest.mark.slow  # processes of 2 to 4 ranks, each loading every family: a minute or more

CHECKPOINTS = {  # family/variant -> builder; "fused" stores each layer's experts as one [E, ...] tensor
    "qwen2_moe": lambda d: tiny.build_qwen2_moe(d, seed=0),
    "qwen2_moe-fused": lambda d: tiny.fused(tiny.build_qwen2_moe(d, seed=8)),
    "hunyuan_v1_moe": lambda d: tiny.build_hunyuan(d, seed=0),
    "solar_open": lambda d: tiny.build_solar(d, seed=0),
    "qwen3_moe": lambda d: tiny_qwen3_moe.build_qwen3_moe(d, seed=0),
    "mixtral": lambda d: tiny_mixtral.build_mixtral(d, seed=0),
    "olmoe": lambda d: tiny_olmoe.build_olmoe(d, seed=0),
    "deepseek_v3": lambda d: tiny_deepseek_v3.build_deepseek_v3(d, seed=0),  # a dense first block
    "glm4_moe": lambda d: tiny_glm4_moe.build_glm4_moe(d, seed=0),  # q/k norm, partial rotary, a dense first block
    "gpt_oss": lambda d: tiny_gpt_oss.build_gpt_oss(d, seed=0),  # expert biases, transposed interleaved layout
    "minimax_m2": lambda d: tiny_minimax_m2.build_minimax_m2(d, seed=0),
    "deepseek_v32": lambda d: tiny_deepseek_v32.build_deepseek_v32(d, seed=0),  # every layer's indexer
    "glm_moe_dsa": lambda d: tiny_glm_moe_dsa.build_glm_moe_dsa(d, seed=0),  # layers sharing a selection
}
# CPU GEMMs round differently with other intra-op thread counts (an environment property, not expert
# parallelism's: one process differs from itself), so the ranks and the reference all run on one thread
THREADS = 1
TOKENS = torch.randint(0, 96, (2, 20), generator=torch.Generator().manual_seed(3))


def observe(model) -> dict:
    """What every rank, and the single-process reference, records of one model."""
    last = model.cfg.n_experts - 1
    first, second = model.cfg.moe_layer_indices[:2]
    logits, cache = model.run_with_cache(TOKENS)
    interventions = [
        (f"blocks.{second}.mlp.hook_expert_indices", lambda idx, hook: torch.full_like(idx, last)),  # all on the last rank
        (f"blocks.{first}.mlp.experts.hook_post", lambda t, hook: t * (torch.arange(t.shape[-1]) % 3)),  # between GEMMs
    ]
    return {
        "logits": logits,
        "cache": dict(cache.items()),
        "rerouted": model.run_with_hooks(TOKENS, fwd_hooks=interventions),
        "generated": model.generate(TOKENS[:, :6], max_new_tokens=5, do_sample=False),
    }


def worker(rank: int, world: int, port: int, paths: dict[str, str], out_dir: str) -> None:
    # torchrun's variables: from_pretrained initialises the gloo group from them
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(THREADS)
    reads: list[tuple[int, int]] = []
    read = ExpertReader.read
    ExpertReader.read = lambda self, layer, expert: reads.append((layer, expert)) or read(self, layer, expert)
    results = {}
    for name, path in paths.items():
        reads.clear()
        model = HookedTransformer.from_pretrained(path, progress=False, expert_parallel=True)
        held = {i: (b.mlp.experts.shard.lo, b.mlp.experts.shard.hi, b.mlp.experts.shard.tensors.gate_up.shape[0])
                for i, b in enumerate(model.blocks) if b.is_moe}
        experts = model.blocks[model.cfg.moe_layer_indices[0]].mlp.experts
        try:
            experts.tensors()  # the full stacks, which this rank does not hold
        except ValueError as err:
            held["W_out"] = str(err)
        held["repr"] = repr(experts)
        results[name] = observe(model) | {"reads": list(reads), "held": held, "backward": backward_error(model)}
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.destroy_process_group()


def backward_error(model) -> str | None:
    try:
        model(TOKENS, return_type="loss").backward()
    except NotImplementedError as err:
        return str(err)
    return None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    root = tmp_path_factory.mktemp("ep")
    return {name: str(build(root / name)) for name, build in CHECKPOINTS.items()}


@pytest.fixture(scope="module")
def reference(paths):
    threads = torch.get_num_threads()
    torch.set_num_threads(THREADS)
    try:
        return {name: observe(HookedTransformer.from_pretrained(p, progress=False)) for name, p in paths.items()}
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("world", [2, 3, 4])  # 3 does not divide the 8 experts: ranks hold 2, 3 and 3
def test_every_rank_equals_one_process(paths, reference, world, tmp_path):
    mp.spawn(worker, args=(world, free_port(), paths, str(tmp_path)), nprocs=world, start_method="spawn")
    for rank in range(world):
        results = torch.load(tmp_path / f"rank{rank}.pt")
        for name, ref in reference.items():
            got = results[name]
            where = f"rank {rank}/{world}, {name}"
            for key in ("logits", "rerouted", "generated"):
                assert torch.equal(got[key], ref[key]), f"{where}: {key}"
            assert got["cache"].keys() == ref["cache"].keys()
            for hook, t in ref["cache"].items():
                assert torch.equal(got["cache"][hook], t), f"{where}: {hook}"
            lo, hi = expert_range(8, world, rank)
            held = got["held"]
            assert f"experts {lo}..{hi - 1} of 8 on rank {rank} of {world}" in held.pop("repr"), where
            assert "with expert_parallel this rank holds only" in held.pop("W_out"), where  # not the full stacks
            assert held == {i: (lo, hi, hi - lo) for i in held}, where
            assert got["reads"] == [(i, e) for i in sorted(held) for e in range(lo, hi)], where
            assert "gradients through the routed experts are not supported" in got["backward"], where


def test_expert_ranges_split_unevenly_and_cover_all():
    for n_experts, world in [(8, 3), (5, 4), (3, 4), (64, 7)]:
        ranges = [expert_range(n_experts, world, r) for r in range(world)]
        assert ranges[0][0] == 0 and ranges[-1][1] == n_experts
        assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
        assert max(hi - lo for lo, hi in ranges) - min(hi - lo for lo, hi in ranges) <= 1


def test_expert_parallel_arguments_are_checked(paths, monkeypatch):
    path = paths["qwen2_moe"]
    for kwargs, match in [
        ({"fold_ln": True}, "fold_ln"),
        ({"device_map": {"embed": "cpu", "blocks.0-2": "cpu", "ln_final": "cpu", "unembed": "cpu"}}, "device_map"),
        ({"expert_offload": "disk"}, "expert_offload"),
        ({"experts_backend": "triton"}, "torch path"),
        ({"expert_parallel_timeout": 0}, "positive number of seconds"),
        ({"expert_parallel_timeout": float("nan")}, "positive number of seconds"),
    ]:
        with pytest.raises(ValueError, match=match):
            HookedTransformer.from_pretrained(path, progress=False, expert_parallel=True, **kwargs)
    with pytest.raises(ValueError, match="it needs expert_parallel"):
        HookedTransformer.from_pretrained(path, progress=False, expert_parallel_timeout=10)
    if not dist.is_initialized():
        for var in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
            monkeypatch.delenv(var, raising=False)
        with pytest.raises(RuntimeError, match="torchrun"):
            HookedTransformer.from_pretrained(path, progress=False, expert_parallel=True)


# ---- ranks that diverge ------------------------------------------------------------------------------------
DIVERGE_WORLD = 3  # rank 1 diverges; rank 2 agrees with rank 0 and must raise all the same


def diverging_scenarios(rank: int, model) -> dict:
    """Each scenario run by every rank, in order: ("ok", logits) or ("error", message) per rank."""
    double = lambda t, hook: t * 2  # noqa: E731
    last = model.cfg.n_experts - 1
    forwards = {
        # a hook on rank 1 only that changes what rank 1's experts compute for every rank
        "hook_on_one_rank": lambda: model.run_with_hooks(TOKENS, fwd_hooks=[("blocks.0.mlp.experts.hook_post", double)] if rank == 1 else []),
        # a hook that only reads, on rank 1 only: nothing differs, nothing is refused
        "cache_on_one_rank": lambda: model.run_with_cache(TOKENS)[0] if rank == 1 else model(TOKENS),
        "rerouting_hook_on_one_rank": lambda: model.run_with_hooks(
            TOKENS, fwd_hooks=[("blocks.1.mlp.hook_expert_indices", lambda idx, hook: torch.full_like(idx, last))] if rank == 1 else []
        ),
        "other_batch_shape": lambda: model(TOKENS[:1] if rank == 1 else TOKENS),
        "other_tokens": lambda: model(TOKENS.flip(-1) if rank == 1 else TOKENS),
        "other_weights": lambda: other_weights_on_rank_1(rank, model),
        "other_sampling_seed": lambda: (torch.manual_seed(rank == 1), model.generate(TOKENS[:, :4], max_new_tokens=6, do_sample=True))[1],
        "exception_caught_on_one_rank": lambda: caught_then_forward(rank, model),
        "after_all_that": lambda: model(TOKENS),  # the group is still usable
    }
    out = {}
    for name, forward in forwards.items():
        try:
            out[name] = ("ok", forward())
        except ExpertParallelError as err:
            out[name] = ("error", str(err))
    return out


def other_weights_on_rank_1(rank: int, model):
    """Rank 1's embedding scaled, as if it had loaded another checkpoint of the same shapes."""
    W_E = model.embed.weight
    kept = W_E.detach().clone()
    with torch.no_grad():
        if rank == 1:
            W_E.mul_(1.5)
        try:
            return model(TOKENS)
        finally:
            W_E.copy_(kept)


def caught_then_forward(rank: int, model):
    """Rank 1's forward raises in a hook before layer 1 and rank 1 carries on with the next forward, while the
    others are still in the first one (waiting at layer 1's exchange)."""
    if rank == 1:
        def fail(t, hook):
            raise KeyError("a hook failed on rank 1")
        try:
            model.run_with_hooks(TOKENS, fwd_hooks=[("blocks.1.hook_resid_pre", fail)])
        except KeyError:
            pass
    return model(TOKENS)


def stall(rank: int, model) -> tuple[str, str, float]:
    """Rank 1 sleeps past the timeout before layer 0's first exchange; every rank must raise."""
    dist.barrier()  # all start the forward together
    start = time.monotonic()
    sleep = lambda t, hook: time.sleep(STALL_S)  # noqa: E731
    try:
        model.run_with_hooks(TOKENS, fwd_hooks=[("blocks.0.hook_resid_pre", sleep)] if rank == 1 else [])
    except ExpertParallelError as err:
        return "error", str(err), time.monotonic() - start
    return "ok", "", time.monotonic() - start


TIMEOUT_S, STALL_S = 2.0, 6.0


def diverge_worker(rank: int, world: int, port: int, path: str, out_dir: str) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(THREADS)
    model = HookedTransformer.from_pretrained(path, progress=False, expert_parallel=True)
    results = diverging_scenarios(rank, model)
    if rank == 1:  # loading takes each rank its own time, longer than the timeout apart: still loads
        time.sleep(TIMEOUT_S * 1.5)
    timed = HookedTransformer.from_pretrained(path, progress=False, expert_parallel=True, expert_parallel_timeout=TIMEOUT_S)
    results["stall"] = stall(rank, timed)
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.destroy_process_group()


def test_ranks_that_diverge_raise_on_every_rank_naming_what_differed(tmp_path):
    path = str(tiny.build_qwen2_moe(tmp_path / "qwen2_moe", seed=0))
    threads = torch.get_num_threads()
    torch.set_num_threads(THREADS)
    try:
        ref = HookedTransformer.from_pretrained(path, progress=False)(TOKENS)
    finally:
        torch.set_num_threads(threads)
    mp.spawn(diverge_worker, args=(DIVERGE_WORLD, free_port(), path, str(tmp_path)), nprocs=DIVERGE_WORLD, start_method="spawn")
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(DIVERGE_WORLD)]
    expected = {  # scenario -> what every rank's error must say (the cause, then each differing field)
        "hook_on_one_rank": ["layer 0's down exchange", "the experts' input rows differ", "ranks 0, 2: hash",
                             "routed experts' sites: ranks 0, 2: none; rank 1: post"],
        "rerouting_hook_on_one_rank": ["layer 1's gate_up exchange", "the routing differs", "routing: ranks 0, 2: hash"],
        "other_batch_shape": ["layer 0's gate_up exchange", "different batch shapes", "tokens: ranks 0, 2: 40; rank 1: 20"],
        # other inputs to the experts: the routing differs too, or only the rows
        "other_tokens": ["layer 0's gate_up exchange", "inputs: ranks 0, 2: hash"],
        "other_weights": ["layer 0's gate_up exchange", "inputs: ranks 0, 2: hash"],
        "other_sampling_seed": ["gate_up exchange", "inputs: ranks 0, 2: hash"],
        "exception_caught_on_one_rank": ["an expert exchange", "different layers", "layer: ranks 0, 2: 1; rank 1: 0"],
    }
    for rank, results in enumerate(ranks):
        for name, parts in expected.items():
            status, message = results[name]
            assert status == "error", f"rank {rank}, {name}: no error"
            for part in parts:
                assert part in message, f"rank {rank}, {name}: {part!r} not in {message!r}"
        for name in ("cache_on_one_rank", "after_all_that"):
            status, logits = results[name]
            assert status == "ok" and torch.equal(logits, ref), f"rank {rank}, {name}"
        status, message, seconds = results["stall"]
        assert status == "error", f"rank {rank}: the stall raised nothing"
        assert "layer 0's gate_up exchange (the check before it) failed on rank" in message, message
        if rank != 1:  # the others waited the timeout for rank 1, then gave up; rank 1 woke to a closed group
            assert "expert_parallel_timeout=2 s" in message and TIMEOUT_S <= seconds < STALL_S, (message, seconds)


def nan_worker(rank: int, world: int, port: int, paths: dict[str, str], out_dir: str) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(THREADS)
    results = {}
    for name, path in paths.items():
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            HookedTransformer.from_pretrained(path, progress=False, expert_parallel=True, expert_storage=STORAGE[name])
        results[name] = [str(w.message) for w in caught if issubclass(w.category, CheckpointWarning)]
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.destroy_process_group()


STORAGE = {"dense": None, "fp8": "fp8"}


def test_each_rank_checks_the_experts_it_holds_for_nan(tmp_path):
    """check_finite under expert parallelism: experts 3 and 6 of layer 1 hold a NaN; rank 0 (experts 0..3)
    warns about expert 3 and rank 1 (4..7) about expert 6, each with the resident load's wording."""
    folders = {"dense": tiny.build_qwen2_moe(tmp_path / "dense", seed=0)}
    folders["fp8"] = tiny_qwen3_moe.build_qwen3_moe(tmp_path / "fp8", seed=0)
    quantize_folder(folders["fp8"], (16, 16))
    poisoned = {  # what each rank must name
        "dense": ["'model.layers.1.mlp.experts.3.up_proj.weight' in model.safetensors: 1 NaN",
                  "'model.layers.1.mlp.experts.6.up_proj.weight' in model.safetensors: 1 NaN"],
        "fp8": ["layer 1 expert 3 W_gate_up:", "layer 1 expert 6 W_gate_up:"],
    }
    for name, folder in folders.items():
        tensors = load_file(folder / "model.safetensors")
        for e in (3, 6):
            key = f"model.layers.1.mlp.experts.{e}.up_proj.weight" + ("_scale_inv" if name == "fp8" else "")
            tensors[key][0, 0] = float("nan")
        save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    mp.spawn(nan_worker, args=(2, free_port(), {n: str(f) for n, f in folders.items()}, str(tmp_path)), nprocs=2, start_method="spawn")
    for rank in range(2):
        results = torch.load(tmp_path / f"rank{rank}.pt")
        for name, parts in poisoned.items():
            messages = results[name]
            assert len(messages) == 1 and "hold NaN or Inf values" in messages[0], (rank, name, messages)
            assert parts[rank] in messages[0] and parts[1 - rank] not in messages[0], (rank, name, messages)
            assert "(from_pretrained(check_finite=False) skips this check)" in messages[0]


def test_content_hash_sees_every_bit_and_ignores_nothing(monkeypatch):
    x = torch.randn(6, 5)
    h = content_hash(x)
    assert content_hash(x.clone()) == h and content_hash(x.t().contiguous().t()) == h  # bytes, not layout
    for i in range(x.numel()):  # one bit of one element: always seen
        flipped = x.clone()
        flipped.view(-1).view(torch.int32)[i] ^= 1
        assert content_hash(flipped) != h, i
    signs, swapped = x.clone(), x.clone()
    signs[0, :2] = torch.tensor([1.5, -1.5])
    swapped[0, :2] = torch.tensor([-1.5, 1.5])  # values that differ in the sign bit only, trading places
    assert content_hash(signs) != content_hash(swapped)
    assert content_hash(x.flip(0)) != h and content_hash(x.flip(1)) != h  # same values, other positions
    for t in (x.to(torch.bfloat16), x.double(), torch.tensor([3, 1, 4]), torch.tensor(2.5)):
        changed = t.clone()
        changed.view(-1)[-1] += 1
        assert content_hash(changed) != content_hash(t), t.dtype
    monkeypatch.setattr(expert_parallel, "HASH_CHUNK", 10)  # two rows at a time: chunking changes nothing
    assert content_hash(x) == h
