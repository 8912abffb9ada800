"""from_pretrained's arguments, checked in one place before anything is resolved, read or built.

Every argument is checked here once: its type, its range, the devices it names (present on this machine),
and the combinations that cannot go together. A bad value is a ValueError (or a TypeError for a value of the
wrong type) naming the argument, the value and what is accepted, so that a mistake costs no download and no
load. pretrained.load works from the LoadOptions this returns and checks nothing about them again; what
depends on the checkpoint (a device map's block range, the model's fit within max_memory) is checked there,
against the checkpoint.
"""

from __future__ import annotations

import difflib
import inspect
from collections.abc import Mapping
from dataclasses import dataclass
from os import PathLike

import torch

from moelens.dtypes import parse_dtype
from moelens.kernels import BACKENDS
from moelens.kernels.expert_parallel import check_timeout
from moelens.loaders.stored_experts import parse_expert_storage
from moelens.placement import BLOCK_KEY, PARTS, check_available, parse_max_memory, parse_size
from moelens.plan import DEFAULT_BATCH, DEFAULT_SEQ, check_tokens
from moelens.tokenizer import MoeTokenizer, check_padding_side

OFFLOAD_MODES = (None, "cpu", "disk")

# TransformerLens's from_pretrained arguments moelens does not honour, each with why and the value that is fine;
# refused by name rather than ignored
UNSUPPORTED = {
    "center_writing_weights": (
        False,
        "on an RMSNorm model, which subtracts no mean, centering the weights that write to the residual stream "
        "would change the model (TransformerLens skips it on RMSNorm models); moelens does not do it on its "
        "LayerNorm models (Phi-3.5-MoE, DBRX) either",
    ),
    "fold_value_biases": (False, "moelens does not fold value biases into b_O: b_V stays where the checkpoint has it"),
    "refactor_factored_attn_matrices": (
        False,
        "with rotary embeddings the QK circuit depends on the positions, so it cannot be refactored "
        "(TransformerLens refuses rotary models too)",
    ),
    "first_n_layers": (None, "moelens loads every layer; run the first n with forward(..., stop_at_layer=n)"),
    "checkpoint_index": (None, "training checkpoints are TransformerLens's own list; load their folder or Hub revision"),
    "checkpoint_value": (None, "training checkpoints are TransformerLens's own list; load their folder or Hub revision"),
    "hf_model": (None, "moelens reads the checkpoint's safetensors itself: pass its folder or Hub id"),
}


@dataclass(frozen=True)
class LoadOptions:
    """from_pretrained's arguments, checked and in their working form."""

    name_or_path: str | PathLike
    dtype: torch.dtype
    device: torch.device  # where the weights go (the first device of n_devices' split)
    device_map: str | dict[str, torch.device] | None  # "auto", the caller's map with its devices parsed, or None
    max_memory: dict[str, int] | None  # bytes per device, for device_map="auto"
    n_devices: int  # > 1: TransformerLens's even split of the blocks from `device` on
    plan_tokens: tuple[int, int]  # (batch, seq) device_map="auto" leaves working memory and KV cache for
    fold_ln: bool
    center_unembed: bool
    check_finite: bool
    progress: bool | None
    revision: str | None
    expert_offload: str | None  # None, "cpu" or "disk"
    expert_cache_bytes: int | None  # None: one layer's experts
    expert_prefetch: bool | None  # None: on for "disk"
    expert_parallel: bool | int  # True: over every rank; G: in groups of G consecutive ranks (each one model)
    expert_parallel_timeout: float  # seconds a rank waits for the others at an expert exchange
    expert_storage: str | None  # "fp8" / "mxfp4": routed experts kept as the checkpoint stores them
    experts_backend: str
    tokenizer: MoeTokenizer | None  # in place of the checkpoint's
    default_prepend_bos: bool | None
    default_padding_side: str

    @property
    def on_meta(self) -> bool:
        """A model built for inspection: its structure, no weights read."""
        return self.device.type == "meta"


def load_options(
    name_or_path,
    *,
    dtype=torch.float32,
    device="cpu",
    revision=None,
    progress=None,
    fold_ln=False,
    center_unembed=False,
    check_finite=True,
    expert_offload=None,
    expert_cache_bytes=None,
    device_map=None,
    max_memory=None,
    expert_parallel=False,
    expert_parallel_timeout=None,
    expert_storage=None,
    expert_prefetch=None,
    experts_backend="auto",
    n_devices=1,
    move_to_device=True,
    plan_batch=None,
    plan_seq=None,
    tokenizer=None,
    default_prepend_bos=None,
    default_padding_side="right",
    center_writing_weights=False,
    fold_value_biases=False,
    refactor_factored_attn_matrices=False,
    first_n_layers=None,
    checkpoint_index=None,
    checkpoint_value=None,
    hf_model=None,
    **others,
) -> LoadOptions:
    """Check every from_pretrained argument (others: keywords from_pretrained does not name; TransformerLens's
    torch_dtype is taken for dtype, anything else is a TypeError naming it)."""
    if "torch_dtype" in others:  # TransformerLens: torch_dtype, when given, wins
        dtype = others.pop("torch_dtype")
    if others:
        known = [*inspect.signature(load_options).parameters, "torch_dtype"]
        named = []
        for key in sorted(others):
            close = difflib.get_close_matches(key, known, n=1)
            named.append(f"{key} (did you mean {close[0]}?)" if close else key)
        raise TypeError(
            f"from_pretrained got keyword(s) moelens does not take: {', '.join(named)} "
            "(TransformerLens hands unknown ones to Hugging Face's from_pretrained; moelens reads the checkpoint itself)"
        )
    if not isinstance(name_or_path, (str, PathLike)):
        raise TypeError(
            f"model_name must be an embedded default name, a folder or a Hub repo id (a str or a path), got "
            f"{type(name_or_path).__name__}"
        )
    refuse_unsupported(
        center_writing_weights=center_writing_weights, fold_value_biases=fold_value_biases,
        refactor_factored_attn_matrices=refactor_factored_attn_matrices, first_n_layers=first_n_layers,
        checkpoint_index=checkpoint_index, checkpoint_value=checkpoint_value, hf_model=hf_model,
    )
    for name, value in [("fold_ln", fold_ln), ("center_unembed", center_unembed), ("check_finite", check_finite),
                        ("move_to_device", move_to_device)]:
        _flag(name, value)
    if not (isinstance(expert_parallel, bool) or isinstance(expert_parallel, int) and expert_parallel >= 1):
        raise TypeError(f"expert_parallel must be True, False or a number of ranks per expert-parallel group, got {expert_parallel!r}")
    for name, value in [("progress", progress), ("expert_prefetch", expert_prefetch),
                        ("default_prepend_bos", default_prepend_bos)]:
        _flag(name, value, none_too=True)
    if revision is not None and not isinstance(revision, str):
        raise TypeError(f"revision must be a Hub revision (a branch, tag or commit as a str), got {revision!r}")
    check_padding_side(default_padding_side, "default_padding_side")
    if experts_backend not in BACKENDS:
        raise ValueError(f"experts_backend must be one of {BACKENDS}, got {experts_backend!r}")
    tokenizer = None if tokenizer is None else MoeTokenizer.coerce(tokenizer)

    device, device_map, n_devices = tl_placement(device, device_map, n_devices, move_to_device)
    dtype, device = parse_dtype(dtype), parse_device(device, "device")
    on_meta = device.type == "meta"
    if not on_meta:
        check_available(device, "device")
    if on_meta and (fold_ln or center_unembed):
        raise ValueError("fold_ln and center_unembed change weights, which a model on device='meta' does not have")
    if device_map is not None and on_meta:
        raise ValueError("device_map places weights on devices; device='meta' builds a model without weights")
    if device_map is not None and device_map != "auto":
        device_map = check_device_map(device_map)
    if max_memory is not None and device_map != "auto":
        raise ValueError("max_memory is what device_map='auto' fills: pass device_map='auto' with it")
    if device_map == "auto":
        max_memory = parse_max_memory(max_memory)
        for name in max_memory:
            check_available(parse_device(name, "max_memory"), f"max_memory[{name!r}]")

    if expert_offload not in OFFLOAD_MODES:
        raise ValueError(f"expert_offload must be one of {OFFLOAD_MODES}, got {expert_offload!r}")
    if expert_offload and (fold_ln or on_meta):
        clash = "device='meta'" if on_meta else "fold_ln (it would rewrite the offloaded experts)"
        raise ValueError(f"expert_offload cannot go with {clash}")
    if expert_cache_bytes is not None:
        expert_cache_bytes = cache_bytes(expert_cache_bytes)
        if not expert_offload:
            raise ValueError("expert_cache_bytes is the size of the offloaded experts' cache: it needs expert_offload")
    if expert_prefetch and not expert_offload:
        raise ValueError("expert_prefetch loads offloaded experts ahead of their layer: it needs expert_offload")
    if expert_parallel:
        clash = [name for name, on in [
            ("fold_ln", fold_ln), ("device='meta'", on_meta), ("device_map", device_map is not None),
            ("expert_offload", expert_offload), ("experts_backend='triton'", experts_backend == "triton"),
        ] if on]
        if clash:
            raise ValueError(
                f"expert_parallel cannot go with {', '.join(clash)} yet: each rank holds its experts whole on `device` "
                "and runs them on the torch path"
            )
    expert_storage = parse_expert_storage(expert_storage)
    if expert_storage and fold_ln:
        raise ValueError(
            f"fold_ln rewrites the routed experts' gate and up rows, which expert_storage={expert_storage!r} keeps as "
            "the checkpoint stores them: load with expert_storage=None to fold"
        )
    if expert_parallel_timeout is not None and not expert_parallel:
        raise ValueError("expert_parallel_timeout is how long expert-parallel ranks wait for each other: it needs expert_parallel")
    return LoadOptions(
        name_or_path=name_or_path, dtype=dtype, device=device, device_map=device_map, max_memory=max_memory,
        n_devices=n_devices, plan_tokens=plan_tokens(plan_batch, plan_seq, device_map), fold_ln=fold_ln,
        center_unembed=center_unembed, check_finite=check_finite, progress=progress, revision=revision,
        expert_offload=expert_offload, expert_cache_bytes=expert_cache_bytes, expert_prefetch=expert_prefetch,
        expert_parallel=expert_parallel, expert_parallel_timeout=check_timeout(expert_parallel_timeout),
        expert_storage=expert_storage,
        experts_backend=experts_backend, tokenizer=tokenizer,
        default_prepend_bos=default_prepend_bos, default_padding_side=default_padding_side,
    )


def refuse_unsupported(**given) -> None:
    for name, value in given.items():
        fine, why = UNSUPPORTED[name]
        if value is not fine and value != fine:
            raise ValueError(f"{name}={value!r} is not supported: {why} (leave {name}={fine!r})")


def _flag(name: str, value, none_too: bool = False) -> None:
    """True or False (or None, where that means a default): 1, "no" or a tensor is not a flag."""
    if not (isinstance(value, bool) or (none_too and value is None)):
        raise TypeError(f"{name} must be True or False{' or None' if none_too else ''}, got {value!r}")


def parse_device(device, what: str) -> torch.device:
    try:
        return torch.device(device)
    except (RuntimeError, TypeError) as err:
        raise ValueError(f"{what} {device!r} is not a torch device ({err})") from err


def check_device_map(spec) -> dict[str, torch.device]:
    """A caller's device map, its keys spelled right and each device one this machine has (not meta: a map
    places weights). Whether it places every block once is checked against the model (placement.parse_device_map)."""
    if not isinstance(spec, Mapping):
        raise TypeError(f"device_map must be 'auto' or a mapping of model parts to devices, got {spec!r}")
    out = {}
    for key, device in spec.items():
        if key not in PARTS and not BLOCK_KEY.match(str(key)):
            raise ValueError(f"device_map key {key!r} is not one of {PARTS}, 'blocks.N' or 'blocks.A-B'")
        dev = parse_device(device, f"device_map[{key!r}] =")
        if dev.type == "meta":
            raise ValueError(
                f"device_map[{key!r}] = {device!r}: a device map places weights, and the meta device holds none "
                "(device='meta', without a map, builds the whole model without weights)"
            )
        check_available(dev, f"device_map[{key!r}]")
        out[key] = dev
    return out


def cache_bytes(value) -> int:
    """expert_cache_bytes: an int of bytes >= 0, or a size as max_memory takes it ("1GB", "80GiB")."""
    if isinstance(value, str):
        return parse_size(value, "expert_cache_bytes")
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(
            f"expert_cache_bytes must be an int of bytes >= 0 or a size like '1GB' or '80GiB', got {value!r} "
            f"({type(value).__name__})"
        )
    if value < 0:
        raise ValueError(f"expert_cache_bytes must be >= 0 (bytes; 0 keeps no expert between uses), got {value}")
    return value


def tl_placement(device, device_map, n_devices, move_to_device: bool):
    """TransformerLens's device / n_devices / move_to_device, checked, as (device, device_map, n_devices):
    n_devices > 1 is turned into a device map once the model's block count is known (pretrained._place)."""
    if device is None:  # TransformerLens's default: the GPU if there is one
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if isinstance(n_devices, bool) or not isinstance(n_devices, int) or n_devices < 1:
        raise ValueError(f"n_devices must be an integer >= 1, got {n_devices!r}")
    if not move_to_device:
        if n_devices > 1 or device_map is not None:
            raise ValueError(
                "move_to_device=False leaves the model on the CPU: it cannot go with n_devices > 1 or a device_map "
                "(TransformerLens needs move_to_device=True for n_devices > 1 too)"
            )
        return "cpu", None, 1
    if n_devices == 1:
        return device, device_map, 1
    if device_map is not None:
        raise ValueError(f"n_devices={n_devices} places the blocks itself: pass n_devices or device_map, not both")
    first = parse_device(device, "device")
    if first.type != "cuda":
        raise ValueError(
            f"n_devices={n_devices} splits the model over CUDA devices: device must be 'cuda' or 'cuda:N', got {device!r}"
        )
    available, start = torch.cuda.device_count(), first.index or 0
    if start + n_devices > available:
        raise ValueError(
            f"n_devices={n_devices} from {first} needs CUDA devices cuda:{start} to cuda:{start + n_devices - 1}; "
            f"this machine has {available} CUDA device(s)"
        )
    return first, None, n_devices


def plan_tokens(plan_batch, plan_seq, device_map) -> tuple[int, int]:
    """(batch, seq) of the forward device_map="auto" leaves working memory and KV cache for."""
    if (plan_batch is not None or plan_seq is not None) and device_map != "auto":
        raise ValueError(
            "plan_batch and plan_seq size the forward that device_map='auto' leaves memory for: pass device_map='auto' "
            f"with them (device_map={device_map!r})"
        )
    batch = DEFAULT_BATCH if plan_batch is None else plan_batch
    seq = DEFAULT_SEQ if plan_seq is None else plan_seq
    check_tokens(plan_batch=batch, plan_seq=seq)
    return batch, seq

