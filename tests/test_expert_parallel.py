"""Expert parallelism moves experts between processes, never math: 2 and 4 gloo ranks on CPU, every family,
bit for bit the single-process resident model (logits, every hook, a re-routing hook, greedy generate),
and each rank reads only its own experts from the checkpoint."""

import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import tiny
import tiny_deepseek_v3
import tiny_mixtral
import tiny_olmoe
import tiny_qwen3_moe
from moelens import HookedTransformer
from moelens.kernels.expert_parallel import expert_range
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
        held = {i: (b.mlp.experts.shard.lo, b.mlp.experts.shard.hi, b.mlp.experts.shard.W_gate_up.shape[0])
                for i, b in enumerate(model.blocks) if b.is_moe}
        experts = model.blocks[model.cfg.moe_layer_indices[0]].mlp.experts
        try:
            experts.W_down  # the full stack, which this rank does not hold
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
    ]:
        with pytest.raises(ValueError, match=match):
            HookedTransformer.from_pretrained(path, progress=False, expert_parallel=True, **kwargs)
    if not dist.is_initialized():
        for var in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
            monkeypatch.delenv(var, raising=False)
        with pytest.raises(RuntimeError, match="torchrun"):
            HookedTransformer.from_pretrained(path, progress=False, expert_parallel=True)
