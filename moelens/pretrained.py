"""Loading a pretrained model: the one place where config, family, placement and the checkpoint's files meet.

resolve the name (embedded default, folder or Hub) -> config.json -> family (by model_type) -> its config
-> its site map -> key map checked against the files' headers -> the model built on meta -> placement
(device map, expert offload, expert parallel) -> each tensor read straight to where it lives.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from functools import partial

import torch

from moelens.experts.spec import ExpertTensors
from moelens.families import family_for
from moelens.fold import untie
from moelens.kernels.expert_parallel import ExpertExchange, ExpertShard, expert_range
from moelens.kernels.offload import ExpertCache, OffloadedExperts
from moelens.load_options import LoadOptions
from moelens.loaders import read_config
from moelens.loaders.checkpoint import check_shapes, fill, key_map, slot_map
from moelens.loaders.config_sizes import check_raw_sizes, check_sizes
from moelens.loaders.errors import CheckpointError
from moelens.loaders.expert_reader import ExpertReader
from moelens.loaders.files import brief
from moelens.loaders.quantized import stored_format
from moelens.loaders.safetensors_files import SafetensorsFiles
from moelens.loaders.stored_experts import ExpertLayers, check_stored_as, stored_layer_bytes
from moelens.locate import resolve  # also pretrained.resolve, for callers that import it from here
from moelens.placement import device_of, parse_device_map
from moelens.plan import auto_device_map
from moelens.tokenizer import MoeTokenizer


def model_slots(model) -> dict[str, torch.Tensor]:
    """Every tensor the checkpoint fills, by name: the model's parameters and buffers, and the routed experts'
    stacks where they are not the model's (offloaded or sharded experts, as meta tensors of their shapes)."""
    slots = dict(model.named_parameters()) | dict(model.named_buffers())
    for layer, block in mixture_layers(model):
        stacks = block.mlp.experts.stacks_held_elsewhere(model.cfg.dtype)
        slots |= {f"blocks.{layer}.mlp.experts.{name}": t for name, t in stacks.items()}
    return slots


def materialize(model: torch.nn.Module, device_for: Callable[[str], torch.device]) -> None:
    """Give every meta parameter and buffer uninitialised storage on its device (device_for(full name)).

    Like Module.to_empty, but through torch.empty_strided with the meta tensors' shapes and strides (a
    parameter laid out transposed stays so: ExpertSpec.down_layout): to_empty's empty_like on meta tensors
    runs torch's Python reference implementation, which imports sympy and torch.fx (~300 MB resident).
    """
    for prefix, module in model.named_modules():
        where = f"{prefix}." if prefix else ""
        for name, param in module._parameters.items():
            if param is not None and param.is_meta:
                empty = torch.empty_strided(param.shape, param.stride(), dtype=param.dtype, device=device_for(where + name))
                module._parameters[name] = torch.nn.Parameter(empty, requires_grad=param.requires_grad)
        for name, buffer in module._buffers.items():
            if buffer is not None and buffer.is_meta:
                module._buffers[name] = torch.empty(buffer.shape, dtype=buffer.dtype, device=device_for(where + name))


def load(cls, options: LoadOptions):
    """The model options.name_or_path holds, placed and loaded as the options (load_options, already checked) say."""
    name_or_path, dtype, device, on_meta = options.name_or_path, options.dtype, options.device, options.on_meta
    device_map, n_devices, expert_offload = options.device_map, options.n_devices, options.expert_offload
    folder = resolve(name_or_path, options.revision)
    hf = read_config(folder)
    model_type = hf.get("model_type")
    if model_type is not None and not isinstance(model_type, str):
        raise CheckpointError(
            f"{folder / 'config.json'}: model_type = {brief(model_type)}; expected a string naming the family"
        )
    fmt = stored_format(hf, folder / "config.json")  # quantized weights are dequantized as they are read
    family = family_for(model_type, folder / "config.json")
    if not issubclass(family, cls):
        raise TypeError(f"{folder} holds a {hf.get('model_type')} model; {cls.__name__} cannot load it")
    files = SafetensorsFiles(folder)  # headers only: the sizes below are checked against them
    check_raw_sizes(hf, files, folder / "config.json")
    try:
        cfg = family.config_from_hf(hf)
    except KeyError as err:
        raise CheckpointError(f"{folder / 'config.json'} lacks the field {err.args[0]!r} that {family.__name__} needs") from err
    except ValueError as err:
        raise CheckpointError(f"{folder / 'config.json'}: {err}") from err
    architectures = hf.get("architectures")  # TransformerLens's cfg.original_architecture: the first listed
    first_architecture = architectures[0] if isinstance(architectures, list) and architectures else None
    cfg = dataclasses.replace(
        cfg, dtype=dtype, original_architecture=first_architecture if isinstance(first_architecture, str) else None,
        expert_placement="offloaded" if expert_offload else "sharded" if options.expert_parallel else "resident",
        expert_storage=options.expert_storage,
    )
    tokenizer = MoeTokenizer.from_folder(folder, hf)  # before the weights: a bad tokenizer file fails fast
    site_map = family.site_map(cfg)
    check_sizes(cfg, site_map, files, folder / "config.json")  # before the key map lists every expert's tensors
    keys = key_map(site_map, files, fmt)
    if options.expert_storage:
        check_stored_as(options.expert_storage, fmt, keys, files, folder / "config.json")
    if cfg.tie_word_embeddings and any("unembed.weight" in t.params for t in keys.values()):
        # tie_word_embeddings, but the checkpoint stores its own head: use it, as transformers does
        cfg = dataclasses.replace(cfg, tie_word_embeddings=False)
    try:
        model = family.build(cfg)
    except ValueError as err:  # what the config asks for that no module can be built for (hidden_act, ...)
        raise CheckpointError(f"{folder / 'config.json'}: {err}") from err
    # every tensor's shape against the model built on meta, before any memory is allocated for it
    check_shapes(model_slots(model), files, keys)
    # made before placing: device_map="auto" leaves room on the devices for its size
    cache_bytes = _default_cache_bytes(model, files, keys) if options.expert_cache_bytes is None else options.expert_cache_bytes
    cache = ExpertCache(cache_bytes) if expert_offload else None
    placed = None
    if device_map is not None or n_devices > 1:
        # "auto" counts the model's parameters; experts kept stored are none, so it plans with them dense (more)
        planned = family.build(dataclasses.replace(cfg, expert_storage=None)) if options.expert_storage else model
        placed = _place(planned, family, device_map, options.max_memory, n_devices, device, options.plan_tokens, cache)
    device_for = (lambda name: device) if placed is None else (lambda name: device_of(placed, name))  # noqa: E731
    offloaded = {}  # slots fill() must not treat as parameters: the experts that stay off the model
    if expert_offload:
        # default: on for "disk", where benchmarks/bench_offload.py measured it paying; "cpu" is unmeasured
        # on a GPU, and on the CPU itself there is nothing to move
        prefetch = expert_offload == "disk" if options.expert_prefetch is None else options.expert_prefetch
        offloaded = offload_experts(model, files, keys, expert_offload, cache, device_for, prefetch, options.check_finite)
    elif options.expert_parallel:
        group = None if options.expert_parallel is True else options.expert_parallel
        offloaded = shard_experts(model, files, keys, device, options.expert_parallel_timeout, group, options.check_finite)
    elif options.expert_storage:
        offloaded = keep_experts_stored(model, files, keys, device_for, read=not on_meta, check_finite=options.check_finite)
    materialize(model, device_for)
    model.tie_weights()
    if on_meta:
        slot_map(model, keys)  # every parameter has its tensor (the shapes were checked above)
    else:
        fill(model, files, keys, progress=options.progress, check_finite=options.check_finite, offloaded=offloaded)
        if placed is not None and placed["unembed"] != placed["embed"] and model.unembed.weight is model.embed.weight:
            untie(model, placed["unembed"])  # a tied head on another device: a copy of its own there
        model.process_weights_(fold_ln=options.fold_ln, center_unembed=options.center_unembed)  # moelens.fold; no-op by default
    model.tokenizer = tokenizer
    model.name_or_path = str(name_or_path)
    # the parts' devices when placed by a map ("auto", n_devices or the caller's), else None
    model.device_map = None if placed is None else {part: str(d) for part, d in placed.items()}
    return model.eval()


def n_devices_map(n_layers: int, n_devices: int, device: torch.device | str) -> dict[str, str]:
    """TransformerLens's n_devices split as a device map: block i on device + i // (n_layers // n_devices) (the
    remainder on the last device, where TransformerLens would run past it), the embedding with block 0, the
    final norm and unembedding with the last block."""
    first = torch.device(device)
    per = n_layers // n_devices
    if per == 0:
        raise ValueError(f"n_devices={n_devices} is more devices than the model has blocks ({n_layers})")
    on = [f"{first.type}:{(first.index or 0) + min(i // per, n_devices - 1)}" for i in range(n_layers)]
    placed = {"embed": on[0]}
    start = 0
    for i in range(1, n_layers + 1):
        if i == n_layers or on[i] != on[start]:
            placed[f"blocks.{start}-{i - 1}"] = on[start]
            start = i
    return placed | {"ln_final": on[-1], "unembed": on[-1]}


def _place(model, family, device_map, max_memory: dict[str, int] | None, n_devices: int, device: torch.device,
           plan_tokens: tuple[int, int], cache: ExpertCache | None) -> dict[str, torch.device]:
    """{part: device} for every part. "auto": moelens plan's placement (plan.auto_device_map) of the model built
    on meta, counting only the non-expert weights and the expert cache when the experts are offloaded."""
    if n_devices > 1:  # TransformerLens's even split of whole blocks
        device_map = n_devices_map(model.cfg.n_layers, n_devices, device)
    if device_map == "auto":
        batch, seq = plan_tokens
        device_map = auto_device_map(
            model, family, max_memory, batch, seq, None if cache is None else cache.capacity_bytes
        )
    return parse_device_map(device_map, model.cfg.n_layers)


def _default_cache_bytes(model, files, keys) -> int:
    """One layer's experts (as stored, where they are kept so): enough for a layer to run in one group and its
    experts to stay for the next forward."""
    if not model.cfg.moe_layer_indices:
        return 0
    spec = model.cfg.expert_spec()
    if spec.storage is not None:
        return stored_layer_bytes(files, keys, model.cfg.moe_layer_indices[0], spec.param_names)
    return model.cfg.n_experts * spec.expert_nbytes(model.cfg.dtype)


def mixture_layers(model) -> list[tuple[int, torch.nn.Module]]:
    """(layer, block) of every mixture block."""
    return [(i, block) for i, block in enumerate(model.blocks) if block.is_moe]


def expert_reader(model, files, keys) -> ExpertReader:
    """Reads one routed expert of any mixture layer from the checkpoint's files (reader.shapes: each full
    stack's shape); what offload ("disk"), expert parallelism and experts kept stored load experts through."""
    return ExpertReader(files, keys, model.cfg.expert_spec().shapes(), model.cfg.dtype)


def dense_slots(model, reader: ExpertReader, layer: int) -> dict[str, torch.Tensor]:
    """Meta tensors of a layer's full dense stacks, for fill() to check the checkpoint's shapes against
    (dequantized shapes, for a quantized checkpoint) without reading anything."""
    return {
        f"blocks.{layer}.mlp.experts.{name}": torch.empty(shape, dtype=model.cfg.dtype, device="meta")
        for name, shape in reader.shapes.items()
    }


def keep_experts_stored(model, files, keys, device_for, read: bool = True, check_finite: bool = True) -> dict[str, torch.Tensor]:
    """expert_storage without offload or expert parallelism: every mixture layer's routed experts read as
    stored onto the layer's device (moelens.experts.stored); returns their dense slots' meta tensors for fill().
    read=False (device='meta'): nothing is read or attached. check_finite: each expert checked as it is read."""
    reader = expert_reader(model, files, keys)
    layers = ExpertLayers(reader, model.cfg.expert_spec(), check_finite)
    slots: dict[str, torch.Tensor] = {}
    for layer, block in mixture_layers(model):
        if read:
            stored = layers.layer(layer, range(model.cfg.n_experts))
            block.mlp.experts.attach_stored(stored.to(device_for(f"blocks.{layer}.mlp.experts")))
        slots.update(dense_slots(model, reader, layer))
    layers.warn_found()
    return slots


def offload_experts(
    model, files, keys, mode, cache: ExpertCache, device_for, prefetch: bool = False, check_finite: bool = True
) -> dict[str, torch.Tensor]:
    """Attach to every mixture layer's routed experts (built "offloaded") an expert store, all sharing one
    cache (each layer's entries on that layer's device); returns their slots for fill(): host tensors ("cpu":
    filled now, pinned when a layer runs on CUDA) or meta tensors ("disk": shape-checked; read when routed to).
    prefetch: each layer loads ahead the experts it predicts for the next one (link_prefetch). check_finite:
    experts read here (stored host stacks) are checked now, experts read from disk the first time each is read
    (fill() checks dense host stacks)."""
    reader = expert_reader(model, files, keys)
    layers = ExpertLayers(reader, model.cfg.expert_spec(), check_finite)  # the cache holds stored bytes where experts are kept so
    slots: dict[str, torch.Tensor] = {}
    stores: dict[int, OffloadedExperts] = {}
    for layer, block in mixture_layers(model):
        device = device_for(f"blocks.{layer}.mlp.experts")
        pin = mode == "cpu" and device.type == "cuda"
        if layers.stored:  # read as stored now ("cpu") or when routed to ("disk"); fill() checks shapes only
            host = layers.layer(layer, range(model.cfg.n_experts)) if mode == "cpu" else None
            host = host.pin_memory() if host is not None and pin else host
            slots.update(dense_slots(model, reader, layer))
        else:  # filled by fill() ("cpu"), or meta ("disk")
            host = ExpertTensors(*(
                torch.empty(shape, dtype=model.cfg.dtype, device="meta" if mode == "disk" else "cpu", pin_memory=pin)
                for shape in reader.shapes.values()
            ))
            slots.update({f"blocks.{layer}.mlp.experts.{name}": t for name, t in zip(reader.params, host.present())})
        if mode == "cpu":
            source = host.expert
        else:
            source = lambda e, layer=layer: layers.read(layer, e)  # noqa: E731
        # what a cache slot holds: one expert as the host stacks, or (stored, on disk) as the files, store it
        template = host.expert(0) if host is not None else layers.read(layer, 0)
        wrap = lambda tensors, layer=layer: layers.wrap(layer, tensors)  # noqa: E731
        read_into = None if mode == "cpu" else lambda e, out, layer=layer: layers.read_into(layer, e, out)
        stores[layer] = OffloadedExperts(layer, model.cfg.n_experts, source, cache, device, mode, template, wrap, read_into)
        block.mlp.experts.attach_store(stores[layer], None if mode == "disk" else host)
    layers.warn_found()
    layers.warn_each_read = True  # from here, experts read from disk when routed to
    if prefetch:
        cache.enable_prefetch()
        link_prefetch(model, stores)
    model.expert_cache = cache
    return slots


def link_prefetch(model, stores: dict[int, OffloadedExperts]) -> None:
    """Prefetch for each mixture layer from the one before it. The predictor: the next layer's router applied
    to this layer's mixture input (the normed residual stream one layer early; the stream changes little
    from one layer to the next, so its top-k is mostly the experts the next layer will choose)."""
    if model.cfg.expert_spec().d_model != model.cfg.d_model:
        return  # the experts read a latent projection of the mixture input, which no router reads: no prediction
    layers = sorted(stores)
    for here, after in zip(layers, layers[1:]):
        stores[here].prefetch_next(stores[after], partial(route, model.blocks[after].mlp.router))


def route(router, x: torch.Tensor) -> torch.Tensor:
    """The experts `router` sends each position of x to (its top-k), hooks aside."""
    return router.choose(router.choice_scores(router.scores(router.logits(x))))


def shard_experts(
    model, files, keys, device: torch.device, timeout_s: float, ranks_per_group: int | None = None,
    check_finite: bool = True,
) -> dict[str, torch.Tensor]:
    """Expert parallelism: give every mixture layer (built "sharded") only this rank's experts
    (kernels.expert_parallel), read expert by expert from the checkpoint's files; returns meta slots for the
    full stacks, so that fill() checks their shapes and reads nothing of the other ranks' experts. The layers
    exchange through one ExpertExchange (checked fingerprints, timeout_s), over every rank, or over this rank's
    group of ranks_per_group consecutive ranks. check_finite: this rank's experts are checked as they are read."""
    exchange = ExpertExchange.create(device, timeout_s, ranks_per_group)
    rank, world = exchange.rank, exchange.world
    lo, hi = expert_range(model.cfg.n_experts, world, rank)
    reader = expert_reader(model, files, keys)
    layers = ExpertLayers(reader, model.cfg.expert_spec(), check_finite)  # as stored, where the experts are kept so
    slots: dict[str, torch.Tensor] = {}
    for layer, block in mixture_layers(model):
        stacks = layers.layer(layer, range(lo, hi))  # more ranks than experts leave some with none
        block.mlp.experts.attach_shard(ExpertShard(
            layer, model.cfg.n_experts, stacks.to(device), rank=rank, world=world, exchange=exchange
        ))
        slots.update(dense_slots(model, reader, layer))
    layers.warn_found()
    return slots
