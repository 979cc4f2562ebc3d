"""One error contract: the same misuse raises the same class on the host and NCCL backends (NCCL
on the fake runtime), the class is an `NcclDdpError` and the builtin users catch, and the message
names the argument."""

import numpy as np
import pytest
from fake_nccl import make_group

from nccl_ddp.comm.host import HostProcessGroup
from nccl_ddp.errors import ConfigError, ConfigTypeError, NcclDdpError


def host_group():
    return HostProcessGroup(None, 0, 1)


def nccl_group():
    return make_group()[0]


MISUSES = [
    ("broadcast root", lambda g: g.broadcast(np.ones(4, np.float32), root=3), ConfigError, "root 3"),
    ("strided buffer", lambda g: g.all_reduce(np.ones(8, np.float32)[::2]), ConfigError, "contiguous"),
    ("complex dtype", lambda g: g.all_reduce(np.ones(4, np.complex64)), ConfigTypeError, "complex64"),
    ("subgroup ranks", lambda g: g.new_subgroup([0, 7]), ConfigError, "7"),
    (
        "all_gather sizes",
        lambda g: g.all_gather(np.ones(3, np.float32), np.ones(2, np.float32)),
        ConfigError,
        "out",
    ),
    (
        "all_gather dtypes",
        lambda g: g.all_gather(np.ones(2, np.float64), np.ones(2, np.float32)),
        ConfigError,
        "float64",
    ),
]


@pytest.mark.parametrize("make", [host_group, nccl_group], ids=["host", "nccl"])
@pytest.mark.parametrize("what, call, cls, named", MISUSES, ids=[m[0] for m in MISUSES])
def test_same_misuse_same_error_on_both_backends(make, what, call, cls, named):
    group = make()
    try:
        with pytest.raises(cls, match=named) as info:
            call(group)
    finally:
        group.shutdown() if hasattr(group, "shutdown") else None
    assert isinstance(info.value, NcclDdpError)
    builtin = TypeError if cls is ConfigTypeError else ValueError
    assert isinstance(info.value, builtin)


def test_each_error_is_one_builtin_kind_as_torchs_are():
    """A bad setting is a ValueError (or TypeError) and no RuntimeError, a failure at run time a
    RuntimeError and no ValueError: `assertRaises(RuntimeError)` written for torch does not pass
    on an unrelated config error (a setting torch refuses with a RuntimeError is a
    ConfigRuntimeError)."""
    import inspect

    from nccl_ddp import errors

    kinds = (ValueError, TypeError, RuntimeError, ImportError)
    both = []
    for name, cls in inspect.getmembers(errors, inspect.isclass):
        if not issubclass(cls, errors.NcclDdpError) or cls is errors.NcclDdpError:
            continue
        mine = [k.__name__ for k in kinds if issubclass(cls, k)]
        assert mine, f"{name} is no builtin kind"
        if len(mine) > 1:
            both.append(name)
    assert both == []
    assert not issubclass(errors.NcclDdpError, RuntimeError)
    assert not issubclass(ConfigError, RuntimeError) and not issubclass(ConfigTypeError, RuntimeError)


def test_the_package_raises_no_bare_base_class():
    """The base class is no builtin kind of its own: raising it, or a subclass of it alone,
    anywhere in the package would escape `except RuntimeError` written for torch."""
    import re

    from paths import ROOT

    bare = []
    for path in sorted((ROOT / "nccl_ddp").rglob("*.py")):
        text = path.read_text()
        bare += [f"{path.name}: raise" for _ in re.finditer(r"raise NcclDdpError\(", text)]
        bare += [f"{path.name}: {m.group(1)}" for m in re.finditer(r"class (\w+)\(NcclDdpError\):", text)]
    assert bare == []
