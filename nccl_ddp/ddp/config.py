"""The options of `DistributedDataParallel`, validated once and then never changed."""

from __future__ import annotations

import dataclasses
import enum
from typing import Any, Literal, Optional, Type, TypeVar, Union

from nccl_ddp.buckets.layout import BucketCaps, MiB
from nccl_ddp.errors import ConfigError, ConfigTypeError
from nccl_ddp.validate import check_bool, check_mib, check_positive_int
from nccl_ddp.zero.config import ZeroConfig, check_zero_config

ReducerMode = Literal["CppReducer", "PythonReducer"]
"""The public `reducer_mode` values, MindSpore's names (there is no C++ here): see `GradPath`."""


class GradPath(enum.Enum):
    """How the reducer moves a step's grads, by role; each value is the `reducer_mode` naming it."""

    FUSED_BUCKETS = "CppReducer"
    """Grads in flat buckets (views of them where the adapter can alias, else one fused
    pack/unpack launch per bucket), one collective per bucket as soon as it is full."""
    PER_GRAD = "PythonReducer"
    """One collective per grad, each scaled by 1/world first, no buckets nor fused kernels (a
    reference path; no comm hooks, no ZeRO-2)."""


REDUCER_MODES = tuple(path.value for path in GradPath)
CheckFinite = Union[bool, Literal["raise"]]
"""The check_finite option: False (off), True (flag, read when asked) or "raise"."""


@dataclasses.dataclass(frozen=True)
class DDPConfig(BucketCaps):
    """Everything the reducer needs to know besides the parameters and the group."""

    init_sync: bool = True
    """Check that every rank has the same parameter shapes/dtypes and the same `rank_settings`,
    then copy rank 0's values. False skips both: a mismatch then shows only at the first step."""
    bucket_cap_mb: Optional[float] = None
    """Bucket size cap in MiB (None: 25). The first bucket is capped at min(1 MiB, cap); 0 puts
    each parameter in its own bucket."""
    find_unused_parameters: bool = False
    """Allow steps in which some parameters get no grad; call `finalize()` after backward then."""
    average_in_collective: bool = False
    """True: all-reduce with the AVG op. False: scale by 1/world while packing, then SUM."""
    static_graph: bool = False
    """The set of used parameters never changes: step 1 finds the unused ones (as with
    find_unused_parameters), later steps leave them out of the buckets."""
    reducer_mode: ReducerMode = "CppReducer"
    """MindSpore's name of the grad path (`grad_path`): "CppReducer" fused buckets
    (`GradPath.FUSED_BUCKETS`), "PythonReducer" one all-reduce per grad (`GradPath.PER_GRAD`)."""
    broadcast_buffers: bool = True
    """PyTorch's default: rank 0's buffers (BatchNorm running statistics and the like) go to every
    rank at construction (with init_sync) and at the start of each forward that follows a
    synchronised one, in one coalesced broadcast. False: buffers stay per rank."""
    broadcast_chunk_mb: float = 25.0
    """Chunk size of the initial parameter broadcast."""
    check_finite: CheckFinite = False
    """True: the pack kernels flag NaN/Inf grads, `last_step_finite` says whether a step had any
    (on any rank). "raise": `NonFiniteGradError` on every rank at the end of such a step."""
    zero: Optional[ZeroConfig] = None
    """Sharding (docs/zero.md): the reducer builds the shard core at construction. Stage 2
    reduce-scatters every bucket (averaged in the collective, whatever average_in_collective
    says) into this rank's shard; stage 1 all-reduces as without it. None: plain DDP."""

    def __post_init__(self) -> None:
        for name in (
            "init_sync",
            "find_unused_parameters",
            "average_in_collective",
            "static_graph",
            "broadcast_buffers",
        ):
            check_bool(name, getattr(self, name))
        if self.bucket_cap_mb is not None:
            check_mib("bucket_cap_mb", self.bucket_cap_mb, allow_zero=True)
        check_mib("broadcast_chunk_mb", self.broadcast_chunk_mb)
        check_finite_option("check_finite", self.check_finite)
        if not isinstance(self.reducer_mode, str) or self.reducer_mode not in REDUCER_MODES:
            raise ConfigError(f"reducer_mode must be one of {REDUCER_MODES}, got {self.reducer_mode!r}")
        zero = check_zero_config(self.zero)
        if zero is not None:
            if zero.bucket_cap_mb is not None:
                raise ConfigError(
                    f"zero=ZeroConfig(bucket_cap_mb={zero.bucket_cap_mb}): a model's shards are cut "
                    "from its own buckets; pass bucket_cap_mb to DistributedDataParallel instead"
                )

    @property
    def grad_path(self) -> GradPath:
        """The grad path `reducer_mode` names."""
        return GradPath(self.reducer_mode)

    @property
    def broadcast_chunk_bytes(self) -> int:
        return int(self.broadcast_chunk_mb * MiB)

    @property
    def rank_settings(self) -> dict:
        """The options every rank must share (init_sync checks them); bucket_cap_mb as used."""
        return {
            "find_unused_parameters": self.find_unused_parameters,
            "average_in_collective": self.average_in_collective,
            "reducer_mode": self.reducer_mode,
            "static_graph": self.static_graph,
            "broadcast_buffers": self.broadcast_buffers,
            "check_finite": self.check_finite,
            "bucket_cap_mb": self.cap_bytes / MiB,
            "zero": None if self.zero is None else repr(self.zero),
        }


COMPRESS = {None: None, "bf16": "bfloat16", "fp16": "float16"}
"""DistributedGradReducer's compress option -> the dtype on the wire."""


@dataclasses.dataclass(frozen=True)
class GradReducerConfig:
    """The options of `DistributedGradReducer`, validated once and then never changed."""

    mean: bool = True
    """Divide the sum by `degree` (MindSpore's `mean`)."""
    degree: Optional[int] = None
    """The divisor for `mean` (None: the group's size)."""
    fusion_type: int = 1
    """0: one all-reduce per grad; n >= 1: grads fused into 25 MiB buckets under fusion id n (a
    parameter's own `comm_fusion` id overrides it)."""
    compress: Optional[str] = None
    """"bf16" / "fp16": float32 buckets travel in that dtype (half the bytes); None: as they are."""
    check_finite: CheckFinite = False
    """As DDPConfig.check_finite, per call."""

    def __post_init__(self) -> None:
        check_bool("mean", self.mean)
        if self.degree is not None:
            check_positive_int("degree", self.degree)
        check_positive_int("fusion_type", self.fusion_type, allow_zero=True)
        if self.compress not in COMPRESS:
            raise ConfigError(f"compress must be one of {sorted(COMPRESS, key=str)}, got {self.compress!r}")
        check_finite_option("check_finite", self.check_finite)


C = TypeVar("C", DDPConfig, GradReducerConfig)


def config_from(cls: Type[C], config: Optional[C], **options: Any) -> C:
    """A wrapper's config: `config` when given (every option must then be left at its default,
    so nothing the caller passed is silently ignored), else one built from the options."""
    built = cls(**options)
    if config is None:
        return built
    if not isinstance(config, cls):
        raise ConfigTypeError(
            f"config must be a {cls.__name__} or None, got {type(config).__name__} {config!r}"
        )
    default = cls()
    changed = [
        f.name for f in dataclasses.fields(built) if getattr(built, f.name) != getattr(default, f.name)
    ]
    if changed:
        raise ConfigError(
            f"pass either config= or the options {changed}, not both: the config "
            f"holds every option (dataclasses.replace(config, ...) changes one)"
        )
    return config


def check_finite_option(name: str, value: object) -> None:
    """check_finite is False, True or "raise"."""
    if value is not False and value is not True and value != "raise":
        raise ConfigError(f'{name} must be False, True or "raise", got {value!r}')
