"""Every error nccl_ddp raises on purpose; catch `NcclDdpError` for all of them.

Messages name the rank, the parameter / bucket / op involved and what to do about it. Each class
is also the one builtin exception torch raises for the same kind of failure: a bad argument or
setting is a `ValueError` (`ConfigError`) or `TypeError` (`ConfigTypeError`), a failure at run
time a `RuntimeError`, so `except ValueError` / `assertRaises(RuntimeError)` written for torch
catch what they would catch from torch, and not more: a setting torch refuses with a
`RuntimeError` is a `ConfigRuntimeError`, no `ConfigError`.
"""

from __future__ import annotations


class NcclDdpError(Exception):
    """Base class of the errors this package raises on purpose."""


class ConfigError(NcclDdpError, ValueError):
    """Inconsistent or missing configuration: environment variables, arguments, launcher flags."""


class ConfigRuntimeError(NcclDdpError, RuntimeError):
    """A setting torch's DDP refuses with a `RuntimeError` (a module with no parameter that
    requires a gradient): torch's class, so code written for torch catches it."""


class ConfigTypeError(NcclDdpError, TypeError):
    """An argument of the wrong type (the `TypeError` twin of `ConfigError`)."""


class StoreError(NcclDdpError, RuntimeError):
    """The key-value store failed: connection refused or lost, protocol error."""


class StoreTimeout(StoreError, TimeoutError):
    """A store get/wait/barrier/connect did not complete within its timeout."""


class AuthError(StoreError):
    """The store refused a client that did not present the job's secret."""


class CommError(NcclDdpError, RuntimeError):
    """A collective failed (transport error, NCCL async error, a peer died)."""


class CommTimeout(CommError, TimeoutError):
    """A collective, stream or event wait did not complete within its timeout."""


class RankMismatchError(NcclDdpError, RuntimeError):
    """Ranks disagree on something that must match (parameter shapes, bucket layout, op order)."""


class ReducerError(NcclDdpError, RuntimeError):
    """Misuse of the reducer during a step: grads missing, a grad marked ready twice, ..."""


class CommHookError(ReducerError):
    """A registered comm hook failed a step: it returned something other than the reduced bucket
    (a wrong type, shape or dtype). The step is broken; later steps say so, naming this error."""


class KernelError(NcclDdpError, RuntimeError):
    """A CUDA kernel could not be found, compiled or launched."""


class JoinError(NcclDdpError, RuntimeError):
    """Inside `Join`: a rank raised (the others name it instead of hanging), or a rank ran out of
    inputs with `throw_on_early_termination=True`."""


class NonFiniteGradError(NcclDdpError, RuntimeError):
    """`check_finite="raise"`: a step's grads held NaN or Inf (raised on every rank)."""


class FrameworkVersionError(NcclDdpError, ImportError):
    """A glue library (Lightning, Accelerate) lacks a private name our glue relies on: a version
    newer than the one we test. The message names the name and the tested version."""


class ShardedGradError(NcclDdpError, RuntimeError):
    """Under ZeRO-2 a `p.grad` holds this rank's local grad (the averaged one exists only as each
    rank's shard), and code read it as the averaged grad (e.g. torch's `clip_grad_norm_`)."""
