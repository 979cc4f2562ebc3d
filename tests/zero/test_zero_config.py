"""ZeroConfig is validated once, when built, with errors naming the parameter and the value; the
bucket-size check is the one DDPConfig uses (validate.check_mib)."""

import math

import numpy as np
import pytest

import nccl_ddp as nd
from nccl_ddp.ddp.config import DDPConfig
from nccl_ddp.errors import ConfigError, ConfigTypeError


@pytest.mark.parametrize("bad", [-1, 0, 0.0, math.inf, -math.inf, math.nan])
def test_bucket_cap_mb_must_be_finite_and_positive(bad):
    with pytest.raises(ConfigError, match=r"bucket_cap_mb must be a finite number > 0 MiB, got"):
        nd.ZeroConfig(stage=2, bucket_cap_mb=bad)


@pytest.mark.parametrize("bad", ["25", True, None.__class__])
def test_bucket_cap_mb_must_be_a_number(bad):
    with pytest.raises(ConfigTypeError, match="bucket_cap_mb must be a number of MiB"):
        nd.ZeroConfig(stage=2, bucket_cap_mb=bad)


@pytest.mark.parametrize("bad", [-1, math.inf, math.nan])
def test_ddp_config_refuses_the_same_sizes_with_the_same_check(bad):
    with pytest.raises(ConfigError, match=r"bucket_cap_mb must be a finite number >= 0 MiB"):
        DDPConfig(bucket_cap_mb=bad)
    assert DDPConfig(bucket_cap_mb=0).cap_bytes == 0  # DDP: 0 is one parameter per bucket


@pytest.mark.parametrize("bad", [0, 3, True, "2", None])
def test_stage_is_1_or_2(bad):
    with pytest.raises(ConfigError, match="stage must be 1 or 2"):
        nd.ZeroConfig(stage=bad)


def test_reduce_dtype_is_float32_or_none_and_stage_2_only():
    for spelling in ("float32", np.float32, np.dtype(np.float32)):
        assert nd.ZeroConfig(stage=2, reduce_dtype=spelling).reduce_dtype == np.dtype(np.float32)
    assert nd.ZeroConfig(stage=2).reduce_dtype is None
    with pytest.raises(ConfigError, match="reduce_dtype must be None .* got 'float16'"):
        nd.ZeroConfig(stage=2, reduce_dtype="float16")
    with pytest.raises(ConfigError, match="reduce_dtype=float32 needs stage=2"):
        nd.ZeroConfig(stage=1, reduce_dtype="float32")


def test_overlap_param_gather_is_a_bool_and_the_config_is_frozen():
    with pytest.raises(ConfigTypeError, match="overlap_param_gather must be a bool"):
        nd.ZeroConfig(stage=2, overlap_param_gather=1)
    with pytest.raises(ConfigError, match="overlap_param_gather=True needs stage=2"):
        nd.ZeroConfig(stage=1, overlap_param_gather=True)
    cfg = nd.ZeroConfig(stage=2, bucket_cap_mb=0.5)
    assert cfg.cap_bytes == 2**19 and cfg.first_cap_bytes == 2**19
    with pytest.raises(AttributeError):
        cfg.stage = 1  # type: ignore[misc]


@pytest.mark.slow  # imports torch
def test_torch_float32_is_read_by_name():
    torch = pytest.importorskip("torch")
    assert nd.ZeroConfig(stage=2, reduce_dtype=torch.float32).reduce_dtype == np.dtype(np.float32)
    with pytest.raises(ConfigError, match="torch.bfloat16"):
        nd.ZeroConfig(stage=2, reduce_dtype=torch.bfloat16)
